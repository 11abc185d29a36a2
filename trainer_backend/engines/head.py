"""The output layer and the target log-probs, in chunks of positions (a "chunked linear log-prob").

A 49k-vocabulary model's logits at N trained positions are N x 49,152 floats per copy (the
logits, the temperature-scaled or truncated copy, their gradients): 16 rows x 130 positions
are 0.4 GB a copy in fp32. Here the output layer runs on the decoder's hidden states one
chunk of positions at a time under `torch.utils.checkpoint`, so a chunk's logits exist only
while its log-probs are taken, and again while its gradient is formed in backward: one
chunk's logits (and their gradient) live at once. Forward and backward compute the same
values as the full-vocabulary path (tests/trainer/test_head.py), at the cost of one more
output-layer matmul per chunk in backward. It is the idea of Liger's fused linear
cross-entropy in plain torch.

Only for models whose logits are exactly `lm_head(hidden)` (Llama, Qwen2, Mistral, ...):
`split_head` returns None for others (logit soft-capping, scaled logits) and the engine
falls back to the model's own forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from trainer_backend.algorithms.logprobs import sampled_logits, token_logprobs_entropy

# Config attributes of models whose logits are not a plain linear layer of the hidden states.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
_PLAIN_HEADS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                "Phi3ForCausalLM", "SmolLM3ForCausalLM")

Sampling = Sequence[torch.Tensor | None]  # (temperature, top_p, top_k), each (B, K) or None


def split_head(model: Any) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, output layer) of a causal LM whose logits are `lm_head(decoder(...))`, else None.

    A peft model is unwrapped: its LoRA layers sit inside the base model's modules, so the
    decoder called directly still runs the active adapter (and `disable_adapter()` still works)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if type(base).__name__ not in _PLAIN_HEADS:
        return None
    if any(getattr(base.config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # a LoRA-wrapped or otherwise modified head: use the model's forward
        return None
    return base.get_decoder(), head


def chunk_positions(vocab: int, budget_mb: float) -> int:
    """How many positions' fp32 logits fit in `budget_mb` (at least one)."""
    return max(1, int(budget_mb * 2**20 // (4 * vocab)))


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, sampling: Sampling,
                  with_entropy: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `targets` (and entropies) under the sampled distribution of `head(hidden)`.

    hidden (B, K, H); targets and each sampling tensor (B, K) or None. Positions are taken in
    chunks of `chunk`; with a single chunk the logits are formed once, without checkpointing
    (the small-model path: no recompute)."""
    shape = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    flat = tuple(None if s is None else s.reshape(-1) for s in sampling)
    if h.shape[0] <= chunk:
        logp, ent = _chunk(h, head.weight, head.bias, t, *flat, with_entropy=with_entropy)
        return logp.view(shape), None if ent is None else ent.view(shape)
    logps, ents = [], []
    for i in range(0, h.shape[0], chunk):
        part = slice(i, i + chunk)
        logp, ent = checkpoint(_chunk, h[part], head.weight, head.bias, t[part],
                               *(None if s is None else s[part] for s in flat),
                               with_entropy=with_entropy, use_reentrant=False)
        logps.append(logp)
        ents.append(ent)
    out_ent = torch.cat(ents).view(shape) if with_entropy else None
    return torch.cat(logps).view(shape), out_ent


def _chunk(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
           temperature: torch.Tensor | None, top_p: torch.Tensor | None, top_k: torch.Tensor | None, *,
           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = torch.nn.functional.linear(h, weight, bias)
    if temperature is not None or top_p is not None or top_k is not None:
        logits = sampled_logits(logits, temperature, top_p, top_k)  # the distribution each token was sampled from
    return token_logprobs_entropy(logits, targets, with_entropy)
