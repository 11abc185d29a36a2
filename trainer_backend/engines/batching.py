"""Rows to padded micro-batches: a greedy split by the tokens the decoder computes (and an
estimate of the activations they keep for backward), tensors shifted to the position that
predicts each token (the step-normalised loss weights come in per row).

Shared prefixes: a GRPO group's rows repeat one prompt (BFCL's ~400-token tool documents, four
times), and the rows of one multi-turn rollout repeat its first turns. `plan_micro_batches` finds
rows that start with the same tokens; the engine decodes those tokens once and the rows' own
tokens on top of them (the prefix's keys and values are shared, gradients flow back through them),
so a group of G rows of prompt P and completion S costs P + G x S tokens instead of G x (P + S).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_middleware.rows import Row

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MicroBatch:
    """Padded tensors for some rows; per-token tensors are shifted to the predicted position."""

    index: tuple[int, ...]  # positions of these rows in the step
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    targets: torch.Tensor  # (B, T-1): input_ids[:, 1:]
    weights: torch.Tensor  # (B, T-1)
    advantages: torch.Tensor  # (B, T-1)
    behaviour_logp: torch.Tensor  # (B, T-1); 0 where unknown
    has_behaviour: torch.Tensor  # (B,) bool
    # The sampling parameters of each predicted token (B, T-1); None: T=1, no truncation anywhere.
    temperature: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    # Rows (positions in this micro-batch) whose first `length` tokens are the same, decoded once;
    # rows in none are decoded together as one padded batch.
    shared: tuple[SharedPrefix, ...] = ()


@dataclass(frozen=True)
class SharedPrefix:
    """Rows whose first `length` tokens are equal (each row has at least one token after them)."""

    rows: tuple[int, ...]
    length: int


@dataclass(frozen=True)
class Plan:
    """One micro-batch to build: row indices of the step, their shared prefixes (in row indices of
    the step), and its cost against the budget: the tokens the decoder computes for it, plus
    CALL_COST per shared prefix."""

    index: tuple[int, ...]
    shared: tuple[SharedPrefix, ...] = ()
    tokens: int = 0


# What a shared prefix's extra decoder calls (one for the prefix, one for the rows on it) cost, in
# tokens of work: a prefix shared by few rows and few tokens is not worth two more calls.
CALL_COST = 32


def split_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Greedy, in order: add rows while rows x longest row stays within max_tokens (a row alone always fits)."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


def run_tokens(shared: int, lengths: Sequence[int]) -> int:
    """What the decoder computes for rows of `lengths` whose first `shared` tokens are equal: those
    once, and each row's own tokens padded to the longest row (shared = 0: a plain padded batch)."""
    return shared + len(lengths) * (max(lengths, default=shared) - shared)


def decoded_tokens(mb: MicroBatch) -> int:
    """The tokens the decoder computes for `mb`: each shared prefix's run, and its lone rows as one
    padded batch (the step's `decoded_tokens` metric; `padded_tokens` is the same without sharing)."""
    lengths = mb.attention_mask.sum(-1).tolist()
    in_groups = {b for g in mb.shared for b in g.rows}
    lone = [n for b, n in enumerate(lengths) if b not in in_groups]
    return sum(run_tokens(g.length, [lengths[b] for b in g.rows]) for g in mb.shared) + run_tokens(0, lone)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_micro_batches(seqs: Sequence[Sequence[int]], max_tokens: int, *, share: bool = True,
                       call_cost: int = CALL_COST) -> list[Plan]:
    """Micro-batches of rows (token sequences) whose decoder work stays within `max_tokens`.

    share=False: `split_micro_batches` by padded tokens, in order. share=True: the rows are sorted
    by their tokens, so rows with a common prefix are neighbours, and cut into runs by dynamic
    programming: a run of n rows sharing P tokens costs P + n x (its longest row - P) + call_cost,
    a row on its own costs its length, the total is the least. Runs (in the order of their first
    row) and lone rows then fill micro-batches in turn; the lone rows of a micro-batch cost their
    count x the longest of them (one padded batch). Without any shared prefix this is exactly
    the share=False split."""
    n = len(seqs)
    if not share or n < 2:
        return [Plan(tuple(ix), (), run_tokens(0, [len(seqs[i]) for i in ix]))
                for ix in split_micro_batches([len(s) for s in seqs], max_tokens)]
    order = sorted(range(n), key=lambda i: tuple(seqs[i]))
    lcp = [common_prefix(seqs[order[k]], seqs[order[k + 1]]) for k in range(n - 1)]
    # best[j]: least cost of the first j sorted rows; cut[j]: where the last run of them starts.
    best = [0] * (n + 1)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        last = len(seqs[order[j - 1]])
        best[j], cut[j] = best[j - 1] + last, j - 1
        shared_len, shortest, longest = last, last, last
        for i in range(j - 1, 0, -1):  # the run order[i-1 .. j-1], at least two rows
            shared_len = min(shared_len, lcp[i - 1])
            shortest = min(shortest, len(seqs[order[i - 1]]))
            longest = max(longest, len(seqs[order[i - 1]]))
            p = min(shared_len, shortest - 1)  # every row keeps a token of its own after the prefix
            if p <= 0:
                break
            cost = p + (j - i + 1) * (longest - p) + call_cost
            if cost > max_tokens:
                break
            if best[i - 1] + cost < best[j]:
                best[j], cut[j] = best[i - 1] + cost, i - 1
    runs: list[tuple[list[int], int]] = []  # (rows, shared length); 0: a lone row
    j = n
    while j > 0:
        i = cut[j]
        rows = [order[k] for k in range(i, j)]
        p = 0
        if len(rows) > 1:
            p = min(min(lcp[i:j - 1]), min(len(seqs[r]) for r in rows) - 1)
        runs.append((sorted(rows), p))
        j = i
    runs.sort(key=lambda run: run[0][0])
    return _pack(runs, [len(s) for s in seqs], max_tokens, call_cost)


def _pack(runs: list[tuple[list[int], int]], lengths: Sequence[int], max_tokens: int, call_cost: int) -> list[Plan]:
    plans: list[Plan] = []
    index: list[int] = []
    shared: list[SharedPrefix] = []
    lone: list[int] = []
    shared_cost = 0

    def cost(extra_lone: list[int], extra_shared: int) -> int:
        return shared_cost + extra_shared + run_tokens(0, [lengths[i] for i in lone + extra_lone])

    for rows, p in runs:
        add = run_tokens(p, [lengths[r] for r in rows]) + call_cost if p else 0
        if index and cost([] if p else rows, add) > max_tokens:
            plans.append(Plan(tuple(index), tuple(shared), cost([], 0)))
            index, shared, lone, shared_cost = [], [], [], 0
        index += rows
        if p:
            shared.append(SharedPrefix(tuple(rows), p))
            shared_cost += add
        else:
            lone += rows
    if index:
        plans.append(Plan(tuple(index), tuple(shared), cost([], 0)))
    return plans


def activation_bytes_per_token(*, layers: int, hidden: int, intermediate: int | None, dtype_bytes: int,
                               checkpointed: bool = False) -> int:
    """What autograd keeps per token of a micro-batch for backward in a Llama/Qwen2-style decoder.

    Per layer ~13 hidden-sized tensors (norms, q/k/v/o, rotary, residuals, the attention's
    per-head copies) and ~5 intermediate-sized ones (gate, up, SiLU, product): counted on
    SmolLM2-135M's shape with saved-tensor hooks (docs/benchmarks.md), 1.85 MB a token in fp32
    against this formula's 1.82. With gradient checkpointing only each layer's input is kept,
    plus one layer's tensors while it is recomputed."""
    inter = intermediate if intermediate is not None else 4 * hidden
    one_layer = (13 * hidden + 5 * inter) * dtype_bytes
    if checkpointed:
        return layers * hidden * dtype_bytes + one_layer
    return layers * one_layer


def token_budget(model_config: Any, cap: int, budget_mb: float | None, *, dtype_bytes: int,
                 checkpointed: bool) -> int:
    """Padded tokens per micro-batch: `cap`, lowered so that the activations autograd keeps for
    backward stay within `budget_mb` (SmolLM2-135M keeps ~1.8 MB a token in fp32: 8,192 tokens
    would be 15 GB; a tiny test model's budget stays at the cap)."""
    if budget_mb is None:
        return cap
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    per_token = activation_bytes_per_token(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                                           intermediate=getattr(cfg, "intermediate_size", None),
                                           dtype_bytes=dtype_bytes, checkpointed=checkpointed)
    tokens = max(1, int(budget_mb * 2**20 // per_token))
    if tokens < cap:
        log.info("micro-batches of at most %d tokens (activation budget %g MB, ~%.2f MB a token)",
                 tokens, budget_mb, per_token / 2**20)
    return min(tokens, cap)


def make_micro_batch(rows: Sequence[Row], index: Sequence[int], weights: Sequence[torch.Tensor],
                     pad_id: int = 0, shared: Sequence[SharedPrefix] = ()) -> MicroBatch:
    """`shared` names rows by their index in `rows` (a `Plan`'s); the micro-batch holds them by position."""
    T = max(len(rows[i]) for i in index)
    position = {i: b for b, i in enumerate(index)}
    B = len(index)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    w = torch.zeros(B, T)
    blp = torch.zeros(B, T)
    has = torch.zeros(B, dtype=torch.bool)
    for b, i in enumerate(index):
        row, n = rows[i], len(rows[i])
        ids[b, :n] = torch.tensor(row.input_ids)
        attn[b, :n] = 1
        w[b, :n] = weights[i]
        if row.behaviour_logprobs is not None:
            blp[b, :n] = torch.tensor(row.behaviour_logprobs)
            has[b] = True
    adv = _advantages(rows, index, T)
    return MicroBatch(index=tuple(index), input_ids=ids, attention_mask=attn, targets=ids[:, 1:],
                      weights=w[:, 1:], advantages=adv, behaviour_logp=blp[:, 1:], has_behaviour=has,
                      temperature=_per_token(rows, index, T, "temperature", 1.0, torch.float32),
                      top_p=_per_token(rows, index, T, "top_p", 1.0, torch.float32),
                      top_k=_per_token(rows, index, T, "top_k", 0, torch.long),
                      shared=tuple(SharedPrefix(tuple(position[i] for i in g.rows), g.length) for g in shared))


def _advantages(rows: Sequence[Row], index: Sequence[int], T: int) -> torch.Tensor:
    """(B, T-1) advantages at the predicted positions: each row's own, or its per-turn
    `token_advantages` (padding keeps the row's `advantage`: its weight is 0 there)."""
    adv = torch.tensor([rows[i].advantage for i in index], dtype=torch.float32).unsqueeze(-1).expand(len(index), T - 1)
    if all(rows[i].token_advantages is None for i in index):
        return adv
    adv = adv.clone()
    for b, i in enumerate(index):
        per_token = rows[i].token_advantages
        if per_token is not None:
            adv[b, :len(per_token) - 1] = torch.tensor(per_token[1:], dtype=torch.float32)
    return adv


def _per_token(rows: Sequence[Row], index: Sequence[int], T: int, name: str, default: float,
               dtype: torch.dtype) -> torch.Tensor | None:
    """A row field like `temperature` as a (B, T-1) tensor at the predicted positions, or None
    when no row of the micro-batch has it (every token at the default)."""
    if all(getattr(rows[i], name) is None for i in index):
        return None
    out = torch.full((len(index), T), default, dtype=dtype)
    for b, i in enumerate(index):
        values = getattr(rows[i], name)
        if values is not None:
            out[b, :len(values)] = torch.tensor(values, dtype=dtype)
    return out[:, 1:]
