"""SmolLM2-135M-Instruct for the arithmetic demo: its folder with the tools template, and an
optional short SFT warm start on generated calculator demonstrations (or another task's:
`warm_start(..., demonstrations=...)`, as BFCL's train split in bench/bench_bfcl.py).

Why a warm start: the untouched converted model (Q4_1 GGUF, dequantized) never produced a tool
call in SmolLM2's documented format on these problems, nor on a plain weather question
(docs/demo.md, SmolLM2 section), so RL would have no signal. The SFT is a LoRA adapter
trained on a few hundred demonstration episodes, merged into the weights: the warm start is
a plain model folder that vLLM serves as the base, and RL trains a fresh adapter on it.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer_backend.caching import build_once
from trainer_backend.demo.arith import SMOLLM2_TOOLS_TEMPLATE, SYSTEM, TOOL_NAME, calculate, make_problems
from trainer_backend.demo.sft import CoreShare, backward_batch

log = logging.getLogger(__name__)

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# The tool as LangChain's convert_to_openai_tool writes it for the demo's `calculator(expression: str)`.
TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {"name": TOOL_NAME,
                 "description": "Evaluate an arithmetic expression such as '412 - 178' or '23 * 17'.",
                 "parameters": {"properties": {"expression": {"type": "string"}}, "required": ["expression"],
                                "type": "object"}},
}


def tools_model(converted: Path, out: Path) -> Path:
    """The converted SmolLM2 folder with SmolLM2's tool-calling template (weights linked, not copied)."""
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        link = out / name
        if not link.exists():
            link.symlink_to((converted / name).resolve())
    (out / "chat_template.jinja").write_text(SMOLLM2_TOOLS_TEMPLATE)
    return out


@dataclass(frozen=True)
class SmolWarmStart:
    steps: int = 16
    batch: int = 4
    lr: float = 1e-3
    rank: int = 16
    seed: int = 0

    def key(self) -> str:
        return f"s{self.steps}-b{self.batch}-lr{self.lr:g}-r{self.rank}-seed{self.seed}"


def demonstration(problem: dict[str, Any]) -> list[dict[str, Any]]:
    """One episode as the agent sends it: the call with the right expression, the tool's
    result, the answer."""
    result = calculate(problem["expression"])
    call = {"id": "call_0", "type": "function",
            "function": {"name": TOOL_NAME, "arguments": json.dumps({"expression": problem["expression"]})}}
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem["question"]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": f"The answer is {result}."}]


# A demonstration: an episode's messages and the tools it was offered.
Demonstration = tuple[list[dict[str, Any]], list[dict[str, Any]]]


def arith_demonstrations(n: int, seed: int) -> list[Demonstration]:
    """The arithmetic demo's: `n` problems of their own stream (not the eval split)."""
    return [(demonstration(p), [TOOL_SCHEMA]) for p in make_problems(n, seed, "sft")]


def sft_example(tok: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
    """(token IDs, loss mask): the loss covers the assistant turns and their <|im_end|>. `tools`:
    what the episode was offered (None: the calculator; []: none)."""
    text = tok.apply_chat_template(messages, tools=[TOOL_SCHEMA] if tools is None else (tools or None),
                                   tokenize=False)
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    spans, start, head = [], 0, "<|im_start|>assistant\n"
    while (i := text.find(head, start)) >= 0:
        end = text.index("<|im_end|>", i) + len("<|im_end|>")
        spans.append((i + len(head), end))
        start = end
    mask = [int(any(a <= s and e <= b for a, b in spans)) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def warm_start(base: Path, out: Path, cfg: SmolWarmStart,
               demonstrations: Callable[[int, int], list[Demonstration]] = arith_demonstrations) -> Path:
    """LoRA SFT on `demonstrations(steps x batch, seed)` (default: the arithmetic demo's), merged
    into a plain model folder (cached by `out`, which names the config and the demonstrations;
    one process builds it, another asking at once waits)."""
    return build_once(out, ".done", lambda: _build(base, out, cfg, demonstrations))


def _build(base: Path, out: Path, cfg: SmolWarmStart,
           demonstrations: Callable[[int, int], list[Demonstration]]) -> None:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_backend.engines.lora import AdapterConfig, peft_config

    torch.manual_seed(cfg.seed)
    cores = CoreShare()  # not whatever the process last set (an async RL run sets 1)
    cores.start()
    tok = AutoTokenizer.from_pretrained(base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           peft_config(AdapterConfig(rank=cfg.rank, alpha=2 * cfg.rank)))
    examples = demonstrations(cfg.steps * cfg.batch, cfg.seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    t0, tokens = time.perf_counter(), 0
    for step in range(cfg.steps):
        batch = [sft_example(tok, m, t) for m, t in examples[step * cfg.batch:(step + 1) * cfg.batch]]
        loss = backward_batch(model, batch)
        opt.step()
        opt.zero_grad()
        cores.step()
        tokens += sum(len(ids) for ids, _ in batch)
        log.info("smol warm start step %d/%d loss %.3f (%.0f tokens/s)", step + 1, cfg.steps, loss,
                 tokens / (time.perf_counter() - t0))
    merged = model.merge_and_unload()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "chat_template.jinja").write_text(SMOLLM2_TOOLS_TEMPLATE)
    (tmp / "warm_start.json").write_text(json.dumps({**asdict(cfg), "seconds": time.perf_counter() - t0,
                                                     "tokens": tokens, "final_loss": loss}))
    (tmp / ".done").write_text("ok")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
