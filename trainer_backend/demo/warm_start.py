"""The demo's tiny model and its warm start (SFT), built locally with no hub.

A byte-level BPE trained on rendered episodes, a Qwen2-style model (width 128, 4 layers, tied
embeddings, ~1M parameters), then a short SFT on exact-bisection demonstrations with noise and
one habit. The demonstrations are deliberately imperfect so the warm-started policy samples the
right guess only most of the time (baseline 10-60% success at temperature 1) and, through the
habit, loses a third of the secrets at greedy: RL through the middleware then has something to
improve at either. torch / transformers are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer_backend.caching import build_once
from trainer_backend.demo.sft import CoreShare, backward_batch
from trainer_backend.demo.task import (
    DEMO_TURNS,
    HIGH,
    LOW,
    MAX_GUESSES,
    TOOL_SCHEMA,
    bisection_guesses,
    demo_decision,
    episode_messages,
)

log = logging.getLogger(__name__)


def demo_chat_template() -> str:
    """The tiny model's ChatML template with a shorter tools preamble: tools still render as
    JSON inside <tools></tools>, calls as hermes <tool_call> blocks, results as <tool_response>;
    ~60 fewer prompt tokens per call than the Qwen2.5-style preamble (sequences are ~30% shorter,
    so SFT and RL steps are faster)."""
    from trainer_backend.models import CHAT_TEMPLATE

    long = ("{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}\n"
            "{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}")
    tail = ("{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}")
    assert long in CHAT_TEMPLATE and tail in CHAT_TEMPLATE, "models.CHAT_TEMPLATE changed"
    return CHAT_TEMPLATE.replace(long, "{{- '<tools>' }}").replace(tail, "{{- '\\n</tools><|im_end|>\\n' }}")


@dataclass(frozen=True)
class WarmStartConfig:
    seed: int = 0
    vocab_size: int = 1024
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    sft_steps: int = 250
    noise: float = 0.35  # share of demonstrated decisions drawn at random from the consistent range
    # which turn a demonstration ends on, and the share of 3-number ranges demonstrated with their lowest
    # (task.demo_decision). Ending on any turn left the last guesses' contexts 1.7% of the data each, and
    # most builds gave several of them one distribution; ending where bisection finds the secret, each
    # context reads its answers, and the habit is then a greedy error RL can fix (docs/demo.md,
    # "A warm start that reads every answer").
    demo_turn: str = "found"
    habit: float = 0.5
    demos: int = 3000
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 10
    # after the warm-up, linear to lr * min_lr_ratio over the SFT steps. At a constant 3e-3 the policy the
    # SFT ended on was a draw: the same run's step 200/225/250 gave 0/29/32% greedy success, and a
    # different float summation order 74% (docs/demo.md, "The warm start's schedule").
    lr_schedule: str = "linear"
    min_lr_ratio: float = 0.0
    # up to this many runs of the schedule: after the first, another from the weights it ended on while the
    # greedy last guess is wrong at a leaf of the bisection tree. Some builds sit on a loss plateau past the
    # first run's decay: the default seed's bf16 build read 6 of 8 leaves, seed 2's fp32 one read 4, 5, 6,
    # then 8 of 8 (docs/demo.md, "A warm start that stalls"). A build that reads them all stops at one.
    max_rounds: int = 4
    # "auto": bf16 autocast where the CPU computes bf16 natively and faster than fp32, else fp32
    # (trainer_backend.engines.precision); resolved before the cache key, so an AVX2 machine's fp32 warm
    # start and an AVX512-BF16 machine's bf16 one never share a cache folder.
    precision: str = "auto"

    def resolved(self) -> WarmStartConfig:
        """This config with `precision` resolved on this machine ("bf16" or "fp32")."""
        from dataclasses import replace

        from trainer_backend.engines.precision import resolve_precision
        from trainer_backend.engines.torch_config import LR_SCHEDULES

        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"warm-start precision must be auto, bf16 or fp32, not {self.precision!r}")
        if self.demo_turn not in DEMO_TURNS:
            raise ValueError(f"warm-start demo_turn must be one of {', '.join(DEMO_TURNS)}, not {self.demo_turn!r}")
        if not 0.0 <= self.habit <= 1.0:
            raise ValueError(f"warm-start habit must be a probability in [0, 1], not {self.habit!r}")
        if self.max_rounds < 1 or self.sft_steps < 1:  # each run of the schedule ends with a reading
            raise ValueError(f"warm-start max_rounds and sft_steps must be at least 1, not {self.max_rounds!r} "
                             f"and {self.sft_steps!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"warm-start lr_schedule must be one of {', '.join(LR_SCHEDULES)}, "
                             f"not {self.lr_schedule!r}")
        return replace(self, precision=resolve_precision(self.precision))

    def key(self) -> str:
        fields = asdict(self)
        # added later: at the values every build had before they existed they are left out of the key,
        # so those builds keep their folders
        for name, before in (("demo_turn", "any"), ("habit", 0.0), ("max_rounds", 1)):
            if fields[name] == before:
                del fields[name]
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]


def _render(tok: Any, msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
    return tok.apply_chat_template(msgs, tools=[TOOL_SCHEMA], tokenize=False,
                                   add_generation_prompt=generation_prompt)


def build_base_model(out_dir: str | os.PathLike[str], cfg: WarmStartConfig) -> Path:
    """Tokenizer trained on rendered episodes (so the fixed prompt is few tokens and every
    number 1..15 is one token) and a random tied-embedding Qwen2 model."""
    from transformers import PreTrainedTokenizerFast

    from trainer_backend.models import build_tiny_model, default_corpus, save_tokenizer, train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:  # a throwaway tokenizer, only to render the template
        save_tokenizer(train_tokenizer(default_corpus(300), 300), Path(tmp), demo_chat_template())
        boot = PreTrainedTokenizerFast.from_pretrained(tmp)
        texts = []
        for secret in range(LOW, HIGH + 1):
            g = bisection_guesses(secret)
            texts.append(_render(boot, episode_messages(secret, g), False))
        # also non-bisection guesses, so every number and answer appears in every position
        rng = random.Random(cfg.seed)
        for _ in range(200):
            secret = rng.randint(LOW, HIGH)
            g = [rng.randint(LOW, HIGH) for _ in range(rng.randint(1, MAX_GUESSES))]
            texts.append(_render(boot, episode_messages(secret, g), False))
        texts += [json.dumps({"n": n}) for n in range(LOW, HIGH + 1)] * 50
    out = build_tiny_model(out_dir, corpus_texts=texts * 4, vocab_size=cfg.vocab_size, hidden=cfg.hidden,
                           layers=cfg.layers, heads=cfg.heads, max_position=1024, tie_word_embeddings=True,
                           seed=cfg.seed, init_std=0.02)
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    tok.chat_template = demo_chat_template()
    tok.save_pretrained(out)
    cfg_path = Path(out) / "tokenizer_config.json"  # as models._save_tokenizer: a class name both envs know
    tc = json.loads(cfg_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tc, indent=2))
    return Path(out)


def sft_example(tok: Any, secret: int, guesses: Sequence[int] | None = None,
                last_only: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of one episode (default: exact bisection); mask 1 on the assistant
    turns (tool call + <|im_end|>; only the last one with last_only), exactly the tokens the
    policy samples at run time."""
    guesses = list(guesses) if guesses is not None else bisection_guesses(secret)
    msgs = episode_messages(secret, guesses)
    if last_only:
        msgs = msgs[:-1]  # the episode ends with the trained guess
    full = tok(_render(tok, msgs, False), add_special_tokens=False)["input_ids"]
    mask = [0] * len(full)
    for k in range(len(guesses)):
        if last_only and k < len(guesses) - 1:
            continue
        upto = 2 + 2 * k  # messages before the k-th assistant turn
        start = len(tok(_render(tok, msgs[:upto], True), add_special_tokens=False)["input_ids"])
        end = len(tok(_render(tok, msgs[:upto + 1], False), add_special_tokens=False)["input_ids"]) - 1  # drop "\n"
        for i in range(start, end):
            mask[i] = 1
    return full, mask


def warm_start(out_dir: str | os.PathLike[str], cfg: WarmStartConfig = WarmStartConfig(),
               progress: bool = True, save_at: Sequence[int] = (), threads: int | None = None) -> Path:
    """Build the model and run the SFT warm start; cached (a folder with `.done` is reused).
    `cfg.precision` should be resolved already (`cfg.resolved()`): "auto" is resolved here too.
    Two processes asking at once: one builds, the other waits for it (trainer_backend.caching)."""
    cfg = cfg.resolved()
    out = Path(out_dir)
    return build_once(out, ".done", lambda: _build(out, cfg, progress, save_at, threads))


def _build(out: Path, cfg: WarmStartConfig, progress: bool, save_at: Sequence[int], threads: int | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_backend.engines.torch_config import schedule_factor

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    cores = CoreShare(threads)
    cores.start()
    build_base_model(tmp, cfg)
    tok = AutoTokenizer.from_pretrained(tmp)
    demo_rng = random.Random(f"demos:{cfg.seed}")
    cache: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}
    examples = []
    for _ in range(cfg.demos):
        secret = demo_rng.randint(LOW, HIGH)
        g = tuple(demo_decision(secret, demo_rng, cfg.noise, cfg.demo_turn, cfg.habit))
        if (secret, *g) not in cache:
            cache[(secret, *g)] = sft_example(tok, secret, g, last_only=True)
        examples.append(cache[(secret, *g)])
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule_factor(
        s % cfg.sft_steps, cfg.lr_schedule, cfg.warmup_steps, cfg.sft_steps, cfg.min_lr_ratio))
    rng = random.Random(cfg.seed)
    curve: dict[str, list[float]] = {"lr": [], "loss": []}  # per step, kept in warm_start.json
    by_round: list[int] = []  # leaves read right after each run of the schedule
    total = cfg.sft_steps * cfg.max_rounds
    for step in range(total):
        batch = [examples[rng.randrange(len(examples))] for _ in range(cfg.batch_size)]
        curve["lr"].append(float(sched.get_last_lr()[0]))
        opt.zero_grad()
        # the episodes share their 122-token system prompt and tools: decoded once per group of one length
        loss = backward_batch(model, batch, bf16=cfg.precision == "bf16")
        curve["loss"].append(round(loss, 5))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        cores.step()
        if step + 1 in save_at:  # tuning: snapshots next to the output (a shorter run would decay sooner)
            model.save_pretrained(tmp, safe_serialization=True)
            shutil.copytree(tmp, out.with_name(f"{out.name}-step{step + 1}"), dirs_exist_ok=True)
        if progress and (step % 10 == 0 or (step + 1) % cfg.sft_steps == 0):
            print(f"  warm start step {step + 1}/{total}  loss {loss:.3f}", flush=True)
        if (step + 1) % cfg.sft_steps == 0:
            model.eval()
            leaves = last_guesses_of(model, tok)
            model.train()
            by_round.append(sum(1 for row in leaves if row["top"][0][0] == row["secret"]))
            if by_round[-1] == len(leaves):
                break
            if step + 1 < total:
                log.info("the warm start reads %d of %d leaves after %d steps: another %d", by_round[-1],
                         len(leaves), step + 1, cfg.sft_steps)
    model.save_pretrained(tmp, safe_serialization=True)
    right = by_round[-1]
    if right < len(leaves):  # a build that never learned to read the later answers: RL only sharpens it
        log.warning("the warm start's greedy last guess is right at %d of %d leaves of the bisection tree after "
                    "%d runs of its schedule (more: --warm-start-rounds; docs/demo.md, 'A warm start that stalls')",
                    right, len(leaves), len(by_round))
    kept = {**asdict(cfg), "seconds": time.perf_counter() - t0, "curve": curve,
            "leaves_right": right, "leaves_right_by_round": by_round, "last_guesses": leaves}
    (tmp / "warm_start.json").write_text(json.dumps(kept))
    (tmp / ".done").write_text("ok")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("warm start written to %s in %.0f s", out, time.perf_counter() - t0)


def guess_probs(model: Any, tok: Any, secret: int, guesses: Sequence[int]) -> dict[int, float]:
    """The policy's next call after `guesses` (answered as for `secret`): P(guess n) for each n in
    LOW..HIGH, each call's tokens teacher-forced, normalised over the range. Greedy success counts
    the secrets whose argmax path wins; this says what the policy weighs at one step of it."""
    import torch

    scores = {}
    for n in range(LOW, HIGH + 1):
        ids, mask = sft_example(tok, secret, [*guesses, n], last_only=True)  # mask: the call's tokens
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        scores[n] = float(sum(logp[i - 1, ids[i]] for i, m in enumerate(mask) if m))
    top = max(scores.values())
    total = sum(math.exp(v - top) for v in scores.values())
    return {n: math.exp(v - top) / total for n, v in scores.items()}


def last_guesses(model_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """For each secret exact bisection reaches on its last guess: P(the right last guess) after the
    bisection before it, and the three likeliest (docs/demo.md, "Greedy success")."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return last_guesses_of(model, tok)


def last_guesses_of(model: Any, tok: Any) -> list[dict[str, Any]]:
    """`last_guesses` of a loaded model (in eval mode) and its tokenizer."""
    rows = []
    for secret in range(LOW, HIGH + 1):
        path = bisection_guesses(secret)
        if len(path) == MAX_GUESSES:
            probs = guess_probs(model, tok, secret, path[:-1])
            top = sorted(probs.items(), key=lambda x: -x[1])[:3]
            rows.append({"secret": secret, "before": path[:-1], "p_correct": probs[secret], "top": top})
    return rows


def _main(argv: Sequence[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainer_backend.demo.warm_start",
                                description="build the demo's warm start")
    p.add_argument("out_dir", nargs="?")
    p.add_argument("--last-guesses", metavar="MODEL_DIR",
                   help="print a built model's choice of each bisection's last guess instead of building")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=WarmStartConfig.sft_steps)
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto")
    p.add_argument("--demo-turn", choices=DEMO_TURNS, default=WarmStartConfig.demo_turn)
    p.add_argument("--habit", type=float, default=WarmStartConfig.habit)
    p.add_argument("--max-rounds", type=int, default=WarmStartConfig.max_rounds,
                   help="runs of the SFT schedule at most: another while a leaf's last guess is wrong")
    a = p.parse_args(argv)
    if a.last_guesses:
        for row in last_guesses(a.last_guesses):
            top = ", ".join(f"{n}: {q:.2f}" for n, q in row["top"])
            print(f"secret {row['secret']:2d} after {row['before']}: P(right) {row['p_correct']:.2f}  (top: {top})")
        return 0
    if not a.out_dir:
        p.error("give the folder to build the warm start in, or --last-guesses MODEL_DIR")
    print(warm_start(a.out_dir, WarmStartConfig(seed=a.seed, sft_steps=a.sft_steps, precision=a.precision,
                                                          demo_turn=a.demo_turn, habit=a.habit,
                                                          max_rounds=a.max_rounds)))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(_main(sys.argv[1:]))
