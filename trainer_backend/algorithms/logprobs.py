"""The trainer's log-probs: the logits of the distribution a token was sampled from, and the
log-prob and entropy of each target token under them.

Sampling: temperature, then top-k, then top-p, as vLLM's sampler applies them
(`vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p`). So at step 0 the trainer's log-probs
equal those vLLM returns in `--logprobs-mode processed_logprobs` (how `lightning-mw serve` starts
it), and the PPO ratio of a token sampled at temperature 0.7 compares like with like. Truncation
(top-p < 1, top-k) trains the truncated distribution: the set of kept tokens is computed on the
current logits without gradient, and the kept logits are renormalised. A sampled token the current
policy would no longer keep gets a very low log-prob (its ratio goes to 0, and PPO's clip stops
its gradient).

The kernel (`token_logprobs_entropy`) takes the log-probs and entropies in chunks of positions,
in fp32, while the logits stay in their own dtype.

The engine's head (`split_head`, `head_logprobs`): the output layer and the target log-probs, in
chunks of positions (a "chunked linear log-prob"). A 49k-vocabulary model's logits at N trained
positions are N x 49,152 floats per copy (the logits, the temperature-scaled or truncated copy,
their gradients): 16 rows x 130 positions are 0.4 GB a copy in fp32. Here the output layer runs on
the decoder's hidden states one chunk of positions at a time under `torch.utils.checkpoint`, so a
chunk's logits exist only while its log-probs are taken, and again while its gradient is formed in
backward: one chunk's logits (and their gradient) live at once. Forward and backward compute the
same values as the full-vocabulary path (tests/trainer/test_head.py), at the cost of one more
output-layer matmul per chunk in backward. It is the idea of Liger's fused linear cross-entropy in
plain torch.

Only for models whose logits are exactly `lm_head(hidden)` (Llama, Qwen2, Mistral, ...):
`split_head` returns None for others (logit soft-capping, scaled logits) and the engine falls back
to the model's own forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

# ---------------------------------------------------------------- the distribution sampled from


MASKED = -1e9  # finite, so exp() underflows to exactly 0 and 0 * MASKED stays 0 (entropy, backward)


def sampled_logits(logits: torch.Tensor, temperature: torch.Tensor | None, top_p: torch.Tensor | None = None,
                   top_k: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` (..., V) scaled by `temperature` (...) and truncated by `top_k` (..., 0 = off) and
    `top_p` (..., 1 = off); differentiable in the kept logits."""
    if temperature is not None:
        logits = logits / temperature.to(logits.dtype).unsqueeze(-1)
    if top_p is None and top_k is None:
        return logits
    with torch.no_grad():
        drop = _truncated(logits.detach().float(), top_p, top_k)
    return logits.masked_fill(drop, MASKED)


def _truncated(z: torch.Tensor, top_p: torch.Tensor | None, top_k: torch.Tensor | None) -> torch.Tensor:
    """Bool mask of the tokens top-k / top-p leave out (ties at the top-k threshold are kept, at
    least one token always stays), in the order of `z`."""
    V = z.shape[-1]
    sort, idx = z.sort(dim=-1)  # ascending, as vLLM
    drop = torch.zeros_like(sort, dtype=torch.bool)
    if top_k is not None:
        k = top_k.to(torch.long)
        active = (k > 0) & (k < V)
        threshold = sort.gather(-1, (V - k.clamp(1, V)).unsqueeze(-1))
        drop |= active.unsqueeze(-1) & (sort < threshold)
    if top_p is not None:
        p = top_p.to(torch.float32)
        probs = sort.masked_fill(drop, float("-inf")).softmax(dim=-1)
        cut = probs.cumsum(dim=-1) <= (1 - p).unsqueeze(-1)
        cut[..., -1] = False
        drop |= cut & (p < 1).unsqueeze(-1)
    return torch.zeros_like(drop).scatter(-1, idx, drop)


# ---------------------------------------------------------------- log-probs and entropy


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) z."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] for each position; logits (B, T, V), targets (B, T)."""
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(z)[target] and the entropy of softmax(z), in chunks of positions.

    The same values as token_logprobs / entropy_from_logits, but the vocabulary-wide work
    happens one cache-sized chunk at a time in fp32 while the (N, V) logits stay in their own
    dtype (bf16 in the bf16 modes): no fp32 copy of the logits, no dense zero gradient for
    the gather, no saved softmax. Backward recomputes softmax per chunk:
        dlogp/dz = onehot(target) - p,    dH/dz = -p * (log p + H).
    """

    @staticmethod
    def forward(ctx, logits, targets, with_entropy: bool, chunk: int):
        z2 = logits.reshape(-1, logits.shape[-1])
        t2 = targets.reshape(-1, 1)
        n = z2.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else None
        for i in range(0, n, chunk):
            zf = z2[i:i + chunk].float()
            lse_c = torch.logsumexp(zf, dim=-1)
            lse[i:i + chunk] = lse_c
            logp[i:i + chunk] = zf.gather(-1, t2[i:i + chunk]).squeeze(-1) - lse_c
            if ent is not None:
                lp = zf - lse_c.unsqueeze(-1)  # not in place: .float() of fp32 logits is the logits
                ent[i:i + chunk] = -(lp.exp() * lp).sum(-1)
        ctx.save_for_backward(logits, targets, lse, ent if ent is not None else lse)
        ctx.with_entropy, ctx.chunk = with_entropy, chunk
        shape = logits.shape[:-1]
        if ent is None:
            return logp.view(shape), None
        return logp.view(shape), ent.view(shape)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        z2 = logits.reshape(-1, logits.shape[-1])
        t2 = targets.reshape(-1, 1)
        n = z2.shape[0]
        g_lp = g_logp.reshape(-1, 1).float() if g_logp is not None else torch.zeros(n, 1, device=logits.device)
        g_h = g_ent.reshape(-1, 1).float() if (g_ent is not None and ctx.with_entropy) else None
        grad = torch.empty_like(logits).reshape(-1, logits.shape[-1])
        c = ctx.chunk
        for i in range(0, n, c):
            lp = z2[i:i + c].float() - lse[i:i + c].unsqueeze(-1)  # log p (a new tensor, so in-place below is safe)
            p = lp.exp()
            gz = p * -g_lp[i:i + c]
            if g_h is not None:
                gz -= p * lp.add_(ent[i:i + c].unsqueeze(-1)) * g_h[i:i + c]
            gz.scatter_add_(-1, t2[i:i + c], g_lp[i:i + c])
            grad[i:i + c] = gz
        return grad.view_as(logits), None, None, None


def token_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True,
                           chunk: int = 32) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs of the targets, entropies or None), fp32, shape logits.shape[:-1]; differentiable in both.

    Memory-light and fast form of token_logprobs + entropy_from_logits for training: see _TokenLogProbs.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    return _TokenLogProbs.apply(logits, targets, with_entropy, chunk)


# ---------------------------------------------------------------- the engine's head, in chunks of positions


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
