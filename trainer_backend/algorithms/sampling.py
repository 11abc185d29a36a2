"""The logits of the distribution a token was sampled from: temperature, then top-k, then top-p,
as vLLM's sampler applies them (`vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p`).

The trainer's log-probs come from these, so at step 0 they equal the log-probs vLLM returns in
`--logprobs-mode processed_logprobs` (how `lightning-mw serve` starts it) and the PPO ratio of a
token sampled at temperature 0.7 compares like with like. Truncation (top-p < 1, top-k) trains
the truncated distribution: the set of kept tokens is computed on the current logits without
gradient, and the kept logits are renormalised. A sampled token the current policy would no
longer keep gets a very low log-prob (its ratio goes to 0, and PPO's clip stops its gradient).
"""

from __future__ import annotations

import torch

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
