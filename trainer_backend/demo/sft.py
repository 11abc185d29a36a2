"""The warm starts' supervised step and the cores it runs on, shared by the tiny model's SFT
(warm_start.py) and SmolLM2's LoRA SFT (smol_warm.py).

A batch is rows of (token IDs, loss mask). `backward_batch` backpropagates the masked tokens' mean
cross-entropy, the causal LM's `labels` loss over the batch padded (`padded_batch_loss`, kept as
the reference), at the cost of the tokens that loss needs. `CoreShare` gives the loop the cores
other processes leave idle, read again as it goes: a warm start that begins beside a busy test
worker takes the second core once that worker is done.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def shared_prefix(batch: list[tuple[list[int], list[int]]]) -> int:
    """How many leading tokens `backward_batch` decodes once per group of `batch`'s rows: the rows'
    common prefix (each row keeping a token of its own), where that, with the rows grouped by
    length (`length_groups`), computes fewer tokens than the rows one by one; else 0."""
    from trainer_backend.engines.batching import common_prefix

    lengths = [len(ids) for ids, _ in batch]
    if len(batch) < 2:
        return 0
    shared = min(min(common_prefix(batch[0][0], ids) for ids, _ in batch[1:]), min(lengths) - 1)
    return shared if shared > 0 and length_groups(lengths, shared)[0] < sum(lengths) else 0


def length_groups(lengths: list[int], shared: int) -> tuple[int, list[list[int]]]:
    """Rows of `lengths` sharing their first `shared` tokens, in groups that each decode that prefix
    once and their own tokens padded to the group's longest: the grouping (rows sorted by length,
    cut where the padding saved pays for another decode of the prefix) that computes the fewest
    tokens, and that count. The guessing game's episodes come in four lengths, one per guess made:
    one group was padded to the longest; four compute half the tokens."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    ordered = [lengths[i] for i in order]
    # best[k]: the fewest tokens for the k shortest rows; to start, more than any grouping computes
    # (each row alone computes its own length: sum(lengths) in all)
    best, cut = [0] + [sum(lengths) + 1] * len(ordered), [0] * (len(ordered) + 1)
    for end in range(1, len(ordered) + 1):
        for start in range(end):  # the last group: ordered[start:end], padded to ordered[end - 1]
            cost = best[start] + shared + (end - start) * (ordered[end - 1] - shared)
            if cost < best[end]:  # strict: of equal costs, the fewest groups
                best[end], cut[end] = cost, start
    groups, end = [], len(ordered)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return best[-1], groups[::-1]


def backward_batch(model: Any, batch: list[tuple[list[int], list[int]]], bf16: bool = False) -> float:
    """Backpropagate the batch's mean loss over its masked tokens (what a causal LM's `labels`
    loss gives for the batch padded) and return that loss, computing less than the padded batch:
    logits only where the loss reads them (12% of a BFCL batch's positions; the output layer is
    49k wide), and the rows' common prefix decoded once per group of rows of similar length where
    it pays (`shared_prefix`, `length_groups`: the arithmetic demonstrations share ~350 of their
    ~390 tokens, the system prompt and the tool; the guessing game's episodes 122 of 128-233),
    else one row at a time, unpadded (a BFCL batch was 18% padding). docs/benchmarks.md, "The
    SmolLM2 warm start's step". `bf16`: the forward passes under CPU bf16 autocast."""
    import torch
    import torch.nn.functional as F

    from trainer_backend.algorithms.logprobs import split_head
    from trainer_backend.engines.batching import SharedPrefix
    from trainer_backend.engines.torch_engine import decode_shared_prefixes

    targets = [_logit_positions(mask) for _, mask in batch]
    total = sum(len(t) for t in targets)
    if total == 0:
        raise ValueError("no example in the batch has a masked token after its first")
    split, shared = split_head(model), shared_prefix(batch)
    if split is not None and shared:
        decoder, head = split
        ids, attn = _right_padded(batch)
        r = torch.tensor([row for row, t in enumerate(targets) for _ in t])
        c = torch.tensor([i for t in targets for i in t])
        _, groups = length_groups([len(x) for x, _ in batch], shared)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            hidden = decode_shared_prefixes(decoder, ids, attn, [SharedPrefix(tuple(g), shared) for g in groups])
            logits = head(hidden[r, c])
        loss = F.cross_entropy(logits.float(), ids[r, c + 1], reduction="sum") / total
        loss.backward()
        return float(loss.item())
    loss_sum = 0.0
    for (seq, _), positions in zip(batch, targets, strict=True):
        if not positions:
            continue
        keep = torch.tensor(positions, dtype=torch.long)
        tokens = torch.tensor([seq], dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=tokens, logits_to_keep=keep).logits[0]
        one = F.cross_entropy(logits.float(), tokens[0, keep + 1], reduction="sum") / total
        one.backward()
        loss_sum += one.item()
    return loss_sum


def padded_batch_loss(model: Any, batch: list[tuple[list[int], list[int]]], pad: int = 0) -> Any:
    """The batch right-padded, with the causal LM's own `labels` loss: what `backward_batch`
    backpropagates, at the cost it had before (the reference of tests/demo/test_sft.py and
    bench/bench_warm_start.py)."""
    ids, attn = _right_padded(batch, pad)
    labels = _right_padded([([t if m else -100 for t, m in zip(seq, mask, strict=True)], mask)
                            for seq, mask in batch], -100)[0]
    return model(input_ids=ids, attention_mask=attn, labels=labels).loss


def _logit_positions(mask: list[int]) -> list[int]:
    """The positions whose logits predict a masked token: one before it (nothing predicts the first)."""
    return [i - 1 for i in range(1, len(mask)) if mask[i]]


def _right_padded(batch: list[tuple[list[int], list[int]]], pad: int = 0) -> tuple[Any, Any]:
    """(token IDs, attention mask) of `batch`'s rows, right-padded with `pad` to the longest."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (seq, _) in enumerate(batch):
        ids[row, :len(seq)] = torch.tensor(seq)
        attn[row, :len(seq)] = 1
    return ids, attn


def idle_cores(sample_s: float = 0.3) -> int:
    """How many cores other processes left idle over a short sample of /proc/stat, this process's
    own CPU time counted as free (at least 1; all on other OSes)."""
    n = os.cpu_count() or 1
    first, own0, t0 = _cpu_times(), time.process_time(), time.monotonic()
    time.sleep(sample_s)
    last, own1, t1 = _cpu_times(), time.process_time(), time.monotonic()
    if first is None or last is None:
        return n
    return _threads_for(free_cores(n, last[0] - first[0], last[1] - first[1], own1 - own0, t1 - t0), n)


class CoreShare:
    """The intra-op threads of a CPU training loop: the cores other processes leave idle. OpenMP
    threads spin against a busy neighbour (on 2 cores next to one busy process, 2 threads ran 1.8x
    slower than 1; idle, 1.8x faster), so a core is taken only while it is idle. `start()` samples
    /proc/stat; `step()`, called between steps, reads it again once `every_s` has passed, counting
    this process's own CPU time as free (its threads are the ones to size). `threads` fixes the count."""

    def __init__(self, threads: int | None = None, every_s: float = 15.0) -> None:
        self.fixed = threads
        self.every_s = every_s
        self.threads = 0
        self._last: tuple[float, float, tuple[int, int] | None] | None = None

    def start(self) -> int:
        self._set(self.fixed or idle_cores())
        self._last = (time.monotonic(), time.process_time(), _cpu_times())
        return self.threads

    def step(self) -> int:
        if self.fixed or self._last is None or time.monotonic() - self._last[0] < self.every_s:
            return self.threads
        wall0, own0, stat0 = self._last
        now = (time.monotonic(), time.process_time(), _cpu_times())
        self._last = now
        if stat0 is None or now[2] is None:
            return self.threads
        n = os.cpu_count() or 1
        free = free_cores(n, now[2][0] - stat0[0], now[2][1] - stat0[1], now[1] - own0, now[0] - wall0)
        self._set(_threads_for(free, n))
        return self.threads

    def _set(self, threads: int) -> None:
        import torch

        if threads != self.threads:
            if self.threads:
                log.info("SFT threads %d -> %d (cores other processes leave idle)", self.threads, threads)
            torch.set_num_threads(threads)
            self.threads = threads


def free_cores(n: int, jiffies: int, idle_jiffies: int, own_cpu_s: float, wall_s: float) -> float:
    """The cores other processes left free over an interval: `n` less the busy ones
    (`jiffies` of /proc/stat over all cores, `idle_jiffies` of them idle) that were not this
    process's own (`own_cpu_s` of CPU time over `wall_s`)."""
    busy = n * (1 - idle_jiffies / max(1, jiffies))
    return n - max(0.0, busy - own_cpu_s / max(1e-6, wall_s))


def _threads_for(free: float, n: int) -> int:
    return max(1, min(n, int(free + 0.2)))


def _cpu_times() -> tuple[int, int] | None:
    """(all, idle + iowait) jiffies since boot, summed over the cores; None where /proc/stat is not."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]
    except (OSError, ValueError, IndexError):
        return None
