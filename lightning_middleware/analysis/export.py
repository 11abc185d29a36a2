"""Dataset export: `lightning-mw export` and `export_dataset()`.

Two kinds of dataset, from the rollouts that pass an `ExportFilter`:

- "sft": one record per training row (the same rows the trainer builds, via
  `lightning_middleware.rows.build_rows`): chat messages, tools, token IDs, loss mask,
  behaviour logprobs, reward.
- "preferences": per task (GRPO group), the best- vs the worst-rewarded rollout,
  as DPO pairs (prompt / chosen / rejected messages, plus token IDs and masks).

Formats: JSONL (one JSON object a line) or a Hugging Face `datasets` folder
(`Dataset.save_to_disk`; `datasets` is imported only then). The fields are
documented in docs/analysis.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.errors import UsageError
from lightning_middleware.records import LLMCall, Mode, Rollout, RolloutStatus
from lightning_middleware.rows import build_rows
from lightning_middleware.store import TraceStore, default_store_url, open_store

KINDS = ("sft", "preferences")
FORMATS = ("jsonl", "hf")
STATUSES = tuple(s.value for s in RolloutStatus)
MODES = tuple(m.value for m in Mode)


class ExportError(UsageError, ValueError):
    """A bad filter or output; the message says what to change (`lightning-mw export` prints it
    on one line, as every command's bad input)."""


# --------------------------------------------------------------------------
# Filter
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class ExportFilter:
    """Which rollouts to export. None means "any" for every field.

    status: the rollout statuses to keep (default: succeeded only).
    mode: "train" or "val". min/max_reward: inclusive bounds on the final reward (a
    rollout without a final reward fails any reward bound). min/max_policy_version:
    inclusive bounds on the rollout's policy version. task_ids: only these tasks.
    """

    min_reward: float | None = None
    max_reward: float | None = None
    status: tuple[str, ...] | None = (RolloutStatus.SUCCEEDED.value,)
    mode: str | None = None
    min_policy_version: int | None = None
    max_policy_version: int | None = None
    task_ids: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("min_reward", "max_reward"):
            v = getattr(self, name)
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                    raise ExportError(f"{name} must be a number, got {v!r}")
                object.__setattr__(self, name, float(v))
        for name in ("min_policy_version", "max_policy_version"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ExportError(f"{name} must be an integer, got {v!r}")
        if isinstance(self.status, str):
            object.__setattr__(self, "status", (self.status,))
        if self.status is not None:
            bad = [s for s in self.status if s not in STATUSES]
            if bad:
                raise ExportError(f"unknown status {bad[0]!r} (choose from {', '.join(STATUSES)})")
            object.__setattr__(self, "status", tuple(self.status))
        if self.mode is not None and self.mode not in MODES:
            raise ExportError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if isinstance(self.task_ids, str):
            object.__setattr__(self, "task_ids", (self.task_ids,))
        if self.min_reward is not None and self.max_reward is not None and self.min_reward > self.max_reward:
            raise ExportError(f"min_reward {self.min_reward} is above max_reward {self.max_reward}")
        if (self.min_policy_version is not None and self.max_policy_version is not None
                and self.min_policy_version > self.max_policy_version):
            raise ExportError(f"min_policy_version {self.min_policy_version} is above max_policy_version "
                              f"{self.max_policy_version}")

    def keeps(self, r: Rollout) -> bool:
        if self.status is not None and r.status not in self.status:
            return False
        if self.mode is not None and r.mode != self.mode:
            return False
        if self.task_ids is not None and r.task_id not in self.task_ids:
            return False
        if self.min_reward is not None and (r.final_reward is None or r.final_reward < self.min_reward):
            return False
        if self.max_reward is not None and (r.final_reward is None or r.final_reward > self.max_reward):
            return False
        if self.min_policy_version is not None and (r.policy_version is None
                                                    or r.policy_version < self.min_policy_version):
            return False
        if self.max_policy_version is not None and (r.policy_version is None
                                                    or r.policy_version > self.max_policy_version):
            return False
        return True


def select_rollouts(store: TraceStore, flt: ExportFilter) -> list[Rollout]:
    """The rollouts that pass `flt`, oldest first."""
    rs = store.query_rollouts(status=list(flt.status) if flt.status is not None else None, mode=flt.mode,
                              task_id=list(flt.task_ids) if flt.task_ids is not None else None)
    return [r for r in rs if flt.keeps(r)]


# --------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------

def _clean(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if v is not None}


def _reply(call: LLMCall) -> dict[str, Any] | None:
    choices = (call.response or {}).get("choices") or []
    if not choices:
        return None
    ch = choices[0]
    if isinstance(ch.get("message"), dict):
        return _clean(ch["message"])
    if "text" in ch:
        return {"role": "assistant", "content": ch["text"]}
    return None


def conversation(call: LLMCall) -> list[dict[str, Any]]:
    """The call's request messages (a completions prompt as one user message) plus its reply."""
    req = call.request or {}
    msgs = [_clean(m) for m in req.get("messages") or [] if isinstance(m, dict)]
    if not msgs and "prompt" in req:
        msgs = [{"role": "user", "content": str(req["prompt"])}]
    reply = _reply(call)
    return msgs + ([reply] if reply is not None else [])


def _rows_of(store: TraceStore, rollouts: Sequence[Rollout], max_len: int | None
             ) -> Iterator[tuple[Rollout, list[Any], dict[str, LLMCall]]]:
    calls = store.calls_for([r.id for r in rollouts]) if rollouts else {}
    for r in rollouts:
        cs = calls.get(r.id, [])
        rows, _stats = build_rows(cs, rollout_id=r.id, task_id=r.task_id, max_len=max_len)
        yield r, rows, {c.id: c for c in cs}


def sft_records(store: TraceStore, flt: ExportFilter | None = None, *, max_len: int | None = None
                ) -> Iterator[dict[str, Any]]:
    """SFT records, one per training row of each selected rollout (fields: docs/analysis.md)."""
    flt = flt or ExportFilter()
    selected = select_rollouts(store, flt)
    agents, steps = store.agent_rewards([r.id for r in selected]), store.step_rewards([r.id for r in selected])
    for r, rows, by_id in _rows_of(store, selected, max_len):
        for i, row in enumerate(rows):
            last = by_id[row.call_ids[-1]]
            indices = [by_id[c].call_index for c in row.call_ids]
            yield {
                "id": f"{r.id}:{i}",
                "rollout_id": r.id,
                "row_index": i,
                "task_id": r.task_id,
                "agent": row.agent,
                "mode": r.mode,
                "status": r.status,
                "reward": r.final_reward,
                # this row's agent's own reward (multi-agent rollouts), and the per-step rewards of its calls
                "agent_reward": agents.get(r.id, {}).get(row.agent) if row.agent else None,
                "step_rewards": {str(k): v for k, v in steps.get(r.id, {}).items() if k in indices} or None,
                "policy_version": r.policy_version,
                "model": last.model,
                "messages": conversation(last),
                "tools": json.dumps(last.request.get("tools")) if last.request.get("tools") else None,
                "input_ids": list(row.input_ids),
                "loss_mask": list(row.loss_mask),
                "logprobs": list(row.behaviour_logprobs) if row.behaviour_logprobs is not None else None,
                "call_ids": list(row.call_ids),
                "truncated": row.truncated,
            }


def _common_prefix(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def preference_records(store: TraceStore, flt: ExportFilter | None = None, *, min_margin: float = 0.0,
                       max_len: int | None = None) -> Iterator[dict[str, Any]]:
    """DPO pairs: per task, the best vs the worst rollout (first training row of each).

    A group needs two rollouts with a final reward and a training row whose rewards
    differ by more than `min_margin`. Ties in reward go to the earlier rollout.
    """
    flt = flt or ExportFilter()
    candidates = [r for r in select_rollouts(store, flt) if r.final_reward is not None]
    groups: dict[str, list[tuple[Rollout, Any, dict[str, LLMCall]]]] = {}
    for r, rows, by_id in _rows_of(store, candidates, max_len):
        if rows:
            groups.setdefault(r.task_id, []).append((r, rows[0], by_id))
    for task_id, members in groups.items():
        if len(members) < 2:
            continue
        ordered = sorted(members, key=lambda m: (-float(m[0].final_reward or 0.0), m[0].created_at))
        best, worst = ordered[0], ordered[-1]
        margin = float(best[0].final_reward or 0.0) - float(worst[0].final_reward or 0.0)
        if margin <= min_margin:
            continue
        conv = {k: conversation(m[2][m[1].call_ids[-1]]) for k, m in (("chosen", best), ("rejected", worst))}
        n = _common_prefix(conv["chosen"], conv["rejected"])
        rec: dict[str, Any] = {"id": f"{task_id}:{best[0].id}:{worst[0].id}", "task_id": task_id,
                               "prompt": conv["chosen"][:n], "margin": margin}
        for k, (r, row, _by_id) in (("chosen", best), ("rejected", worst)):
            rec.update({
                k: conv[k][n:],
                f"{k}_rollout_id": r.id,
                f"{k}_reward": r.final_reward,
                f"{k}_policy_version": r.policy_version,
                f"{k}_input_ids": list(row.input_ids),
                f"{k}_loss_mask": list(row.loss_mask),
            })
        yield rec


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------

@dataclass
class ExportResult:
    path: str
    kind: str
    format: str
    records: int
    rollouts: int
    info: dict[str, Any] = field(default_factory=dict)


def export_dataset(store: TraceStore | str | None, out: str, *, kind: str = "sft", format: str = "jsonl",
                   filter: ExportFilter | None = None, max_len: int | None = None, min_margin: float = 0.0,
                   overwrite: bool = False) -> ExportResult:
    """Write an SFT or preference dataset of the rollouts passing `filter` to `out`.

    format "jsonl": a file, one record a line. "hf": a `datasets.Dataset` saved with
    `save_to_disk` (load it with `datasets.load_from_disk(out)`).
    """
    if kind not in KINDS:
        raise ExportError(f"unknown kind {kind!r} (choose from {', '.join(KINDS)})")
    if format not in FORMATS:
        raise ExportError(f"unknown format {format!r} (choose from {', '.join(FORMATS)})")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0):
        raise ExportError(f"max_len must be a positive integer, got {max_len!r}")
    if os.path.exists(out) and not overwrite:
        raise ExportError(f"{out} exists (pass overwrite=True / --overwrite to replace it)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ExportError(f"directory {parent} does not exist")
    flt = filter or ExportFilter()
    st = open_store(store)
    if kind == "sft":
        records = list(sft_records(st, flt, max_len=max_len))
        rollouts = len({r["rollout_id"] for r in records})
    else:
        records = list(preference_records(st, flt, min_margin=min_margin, max_len=max_len))
        rollouts = 2 * len(records)
    if format == "jsonl":
        if os.path.isdir(out):
            raise ExportError(f"{out} is a directory; JSONL export writes a file")
        tmp = out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, out)
    else:
        _write_hf(records, out, overwrite)
    return ExportResult(path=out, kind=kind, format=format, records=len(records), rollouts=rollouts)


def _write_hf(records: list[dict[str, Any]], out: str, overwrite: bool) -> None:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ExportError("the 'hf' format needs the `datasets` package: pip install datasets") from exc
    import shutil

    if overwrite and os.path.exists(out):
        if os.path.isdir(out):
            shutil.rmtree(out)
        else:
            os.remove(out)
    # Messages differ in their keys (tool_calls, tool_call_id, ...): give them one schema, the
    # missing keys null, so Arrow can store them as a list of structs.
    rows = [_uniform_messages(r) for r in records]
    ds = datasets.Dataset.from_list(rows) if rows else datasets.Dataset.from_dict({})
    ds.save_to_disk(out)


_MESSAGE_KEYS = ("role", "content", "name", "tool_call_id", "tool_calls")


def _uniform_message(m: dict[str, Any]) -> dict[str, Any]:
    content = m.get("content")
    if content is not None and not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False)  # content parts: kept as JSON text
    calls = m.get("tool_calls")
    return {
        "role": m.get("role"), "content": content, "name": m.get("name"), "tool_call_id": m.get("tool_call_id"),
        "tool_calls": None if not calls else [
            {"id": c.get("id"), "type": c.get("type", "function"),
             "function": {"name": (c.get("function") or {}).get("name"),
                          "arguments": (c.get("function") or {}).get("arguments")}} for c in calls],
    }


def _uniform_messages(rec: dict[str, Any]) -> dict[str, Any]:
    out = dict(rec)
    for k in ("messages", "prompt", "chosen", "rejected"):
        if isinstance(out.get(k), list):
            out[k] = [_uniform_message(m) for m in out[k]]
    return out


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

def _number(flag: str) -> Any:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if math.isnan(v):
            raise argparse.ArgumentTypeError("must be a number, got NaN")
        return v
    parse.__name__ = flag
    return parse


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _positive(text: str) -> int:
    v = _integer(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def _statuses(text: str) -> tuple[str, ...] | None:
    if text == "any":
        return None
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    if not parts:
        raise argparse.ArgumentTypeError("give one or more statuses, comma-separated, or 'any'")
    for p in parts:
        if p not in STATUSES:
            raise argparse.ArgumentTypeError(f"unknown status {p!r} (choose from {', '.join(STATUSES)}, or any)")
    return parts


def _mode(text: str) -> str | None:
    if text == "any":
        return None
    if text not in MODES:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r} (choose from {', '.join(MODES)}, or any)")
    return text


def add_cli(sub: Any) -> None:
    p = sub.add_parser("export", help="write an SFT or preference (DPO) dataset from the store",
                       description="Export rollouts as an SFT dataset (messages, token IDs, loss masks) or as "
                                   "best-vs-worst preference pairs per task, to JSONL or a Hugging Face "
                                   "datasets folder.")
    p.add_argument("--store", default=None, help=f"store URL (default {default_store_url()})")
    p.add_argument("--out", "-o", required=True, help="output: a .jsonl file, or a folder for --format hf")
    p.add_argument("--kind", choices=KINDS, default="sft")
    p.add_argument("--format", choices=FORMATS, default="jsonl")
    p.add_argument("--min-reward", type=_number("min-reward"), default=None)
    p.add_argument("--max-reward", type=_number("max-reward"), default=None)
    p.add_argument("--status", type=_statuses, default=(RolloutStatus.SUCCEEDED.value,),
                   help=f"comma-separated statuses ({', '.join(STATUSES)}) or 'any'; default succeeded")
    p.add_argument("--mode", type=_mode, default=None, help="train, val or any (default any)")
    p.add_argument("--min-policy-version", type=_integer, default=None)
    p.add_argument("--max-policy-version", type=_integer, default=None)
    p.add_argument("--policy-version", type=_integer, default=None, help="exactly this policy version")
    p.add_argument("--task", action="append", default=None, help="only this task id (repeatable)")
    p.add_argument("--max-len", type=_positive, default=None, help="truncate rows to this many tokens")
    p.add_argument("--min-margin", type=_number("min-margin"), default=0.0,
                   help="preferences: keep pairs whose rewards differ by more than this (default 0)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    lo, hi = args.min_policy_version, args.max_policy_version
    if args.policy_version is not None:
        if lo is not None or hi is not None:
            raise ExportError("--policy-version can't be combined with --min/--max-policy-version")
        lo = hi = args.policy_version
    flt = ExportFilter(min_reward=args.min_reward, max_reward=args.max_reward, status=args.status,
                       mode=args.mode, min_policy_version=lo, max_policy_version=hi,
                       task_ids=tuple(args.task) if args.task else None)
    res = export_dataset(args.store, args.out, kind=args.kind, format=args.format, filter=flt,
                         max_len=args.max_len, min_margin=args.min_margin, overwrite=args.overwrite)
    print(f"wrote {res.records} {res.kind} records from {res.rollouts} rollouts to {res.path} ({res.format})")
    return 0
