"""Tiny random Qwen2 checkpoints for engine tests (seconds to build, no download)."""

from __future__ import annotations

import json
from pathlib import Path


def save_tiny_qwen2(out: Path, *, vocab: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    max_positions: int = 128, seed: int = 0) -> Path:
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=max_positions, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out)
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": max_positions}))
    return out
