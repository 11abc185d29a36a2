"""What bench/bench_soak.py concludes from its samples: the counts check, memory growth, the table."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

KINDS = {"w": "wrap_agents", "g": "gateway_agents"}  # task-id prefix -> the agent process that ran it
PROCESSES = ("gateway", "trainer", "wrap_agents", "gateway_agents", "llm_server", "postgres")


def _final(lines: list[dict[str, Any]]) -> dict[str, Any]:
    finals = [line for line in lines if line.get("final")]
    if not finals:
        raise RuntimeError("an agent process ended without its final counts")
    return finals[-1]


def check_counts(lines_by_kind: dict[str, list[dict[str, Any]]], store: dict[str, Any],
                 trained_ids: list[str]) -> dict[str, Any]:
    """The agents' own counts against the store's, per kind. `lost` adds up every mismatch (a call or
    rollout missing from the store, or one there that no agent made): it must be 0."""
    out: dict[str, Any] = {}
    lost = 0
    for prefix, name in KINDS.items():
        agent = _final(lines_by_kind[name])
        recorded, training = store.get(f"{prefix}_calls", 0), store.get(f"{prefix}_training_calls", 0)
        rollouts, succeeded = store.get(f"{prefix}_rollouts", 0), store.get(f"{prefix}_succeeded", 0)
        trained, skipped = store.get(f"{prefix}_trained", 0), store.get(f"{prefix}_skipped", 0)
        row = {"calls_sent": agent["sent"], "calls_answered": agent["ok"], "calls_failed": agent["failed"],
               "calls_recorded": recorded, "training_calls": training,
               "rollouts_finished": agent["rollouts"], "rollouts_recorded": rollouts,
               "rollouts_succeeded": succeeded, "rollouts_trained": trained, "rollouts_skipped": skipped,
               "rollouts_waiting": rollouts - trained - skipped}
        row["lost"] = (abs(agent["sent"] - recorded) + abs(agent["ok"] - training)
                       + abs(agent["rollouts"] - succeeded) + abs(rollouts - succeeded))
        lost += row["lost"]
        out[name] = row
    out["lost"] = lost + store.get("unattached_calls", 0)
    out["unattached_calls"] = store.get("unattached_calls", 0)
    out["train_steps"] = store.get("train_steps", 0)
    out["trained_twice"] = len(trained_ids) - len(set(trained_ids))
    return out


def warmup_ends(samples: list[dict[str, Any]], warmup_s: float, agents: dict[str, int]) -> dict[str, float]:
    """When each process's memory growth starts to count: after `warmup_s`, and after an event that
    says it is warm, not a time (on a loaded machine an agent process was still importing at 6 s,
    and its imports counted as growth): for the trainer its first committed step (its first backward
    pass allocates the autograd and optimizer state: tens of MiB that are no leak); for an agent
    process, and the gateway its agents call through, two finished rollouts per agent of its kind
    (every path, the store's writer and its flush at a rollout's end included, has run)."""
    def first(ready: Callable[[dict[str, Any]], bool]) -> float:
        return next((s["t"] for s in samples if ready(s)), samples[-1]["t"])

    def rollouts_done(kind: str, n: int) -> float:
        return first(lambda s: s.get(f"{kind}_succeeded", 0) >= 2 * n)

    first_step = first(lambda s: s.get("train_steps", 0) >= 1)
    warm = {kind: rollouts_done(kind, n) for kind, n in agents.items()}
    since = {"trainer": first_step, "wrap_agents": warm.get("w", 0.0), "gateway_agents": warm.get("g", 0.0),
             "gateway": warm.get("g", 0.0)}
    return {name: max(warmup_s, since.get(name, 0.0)) for name in PROCESSES}


def memory_summary(samples: list[dict[str, Any]], warmup_s: float, key: str,
                   agents: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per process, in MiB: at the first sample, after its warm-up, at the end (medians of 3 samples,
    so one sample taken mid-garbage-collection does not decide), the peak, the growth after warm-up,
    and over how many seconds that growth was measured."""
    out: dict[str, dict[str, float]] = {}
    for name, since in warmup_ends(samples, warmup_s, agents).items():
        values = [(s["t"], s[key].get(name)) for s in samples]
        values = [(t, v) for t, v in values if v]  # None or 0: exited (a zombie reads 0) or not yet started
        if not values:
            continue
        after = [(t, v) for t, v in values if t >= since] or values[-1:]
        base, end = statistics.median(v for _t, v in after[:3]), statistics.median(v for _t, v in after[-3:])
        out[name] = {"first": values[0][1], "after_warmup": base, "end": end, "peak": max(v for _t, v in values),
                     "growth": end - base, "measured_s": after[-1][0] - after[0][0]}
    return out


def _nearest(samples: list[dict[str, Any]], t: float) -> dict[str, Any]:
    before = [s for s in samples if s["t"] <= t + 1.0]
    return before[-1] if before else samples[0]


def window_rows(lines_by_kind: dict[str, list[dict[str, Any]]], samples: list[dict[str, Any]],
                t0: float) -> list[dict[str, Any]]:
    """One row per agent window: both kinds' latency, with the store's counts and memory at that time."""
    wrap = [line for line in lines_by_kind["wrap_agents"] if not line.get("final")]
    gw = [line for line in lines_by_kind["gateway_agents"] if not line.get("final")]
    rows = []
    last = t0
    for w, g in zip(wrap, gw):
        t, span = w["at"] - t0, max(w["at"] - last, 1e-3)  # the final window is cut short by the deadline
        last = w["at"]
        s = _nearest(samples, t)
        rows.append({
            "t": round(t, 1), "calls_per_s": round((w["calls"] + g["calls"]) / span, 1),
            "wrap_p50_ms": w["p50_ms"], "wrap_p99_ms": w["p99_ms"],
            "gateway_p50_ms": g["p50_ms"], "gateway_p99_ms": g["p99_ms"],
            "failed": w["failed"] + g["failed"], "sent": w["sent"] + g["sent"],
            "recorded": s.get("w_calls", 0) + s.get("g_calls", 0),
            "trained": s.get("w_trained", 0) + s.get("g_trained", 0), "steps": s.get("train_steps", 0),
            "rss_mib": {k: (None if v is None else round(v, 1)) for k, v in s["rss_mib"].items()},
            "anon_mib": {k: (None if v is None else round(v, 1)) for k, v in s["anon_mib"].items()},
            "load": round(s["load"], 2),
        })
    return rows


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def print_report(result: dict[str, Any]) -> None:
    print(f"soak: {result['minutes']} min, {result['wrap_agents']} wrap + {result['gateway_agents']} gateway agents, "
          f"think {result['think_ms']:.0f} ms, upstream {result['llm_latency_ms']:.0f} ms, on {result['cpu']} "
          f"({result['cores']} cores), load average {result['load_avg']['min']:.1f}-{result['load_avg']['max']:.1f}")
    short = {"gateway": "gw", "trainer": "trn", "wrap_agents": "wrap", "gateway_agents": "gwag",
             "llm_server": "llm", "postgres": "pg"}
    head = ("  t(s) calls/s  wrap p50/p99  gw p50/p99  fail    sent  recorded  trained steps  "
            + " ".join(f"{short[p]:>5}" for p in PROCESSES) + "  load")
    print(head)
    for r in result["windows"]:
        rss = " ".join(f"{r['anon_mib'].get(p) or 0:5.0f}" for p in PROCESSES)
        print(f"{r['t']:6.0f} {r['calls_per_s']:7.1f} {_ms(r['wrap_p50_ms']):>6}/{_ms(r['wrap_p99_ms']):<6} "
              f"{_ms(r['gateway_p50_ms']):>5}/{_ms(r['gateway_p99_ms']):<5} {r['failed']:4d} {r['sent']:7d} "
              f"{r['recorded']:9d} {r['trained']:8d} {r['steps']:5d}  {rss} {r['load']:5.1f}")
    print("(anonymous resident memory, RssAnon, MiB; pg: the sum over all its processes)")
    c = result["counts"]
    for name in KINDS.values():
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in c[name].items()))
    print(f"lost {c['lost']}, trained twice {c['trained_twice']}, unattached calls {c['unattached_calls']}, "
          f"train steps {c['train_steps']}")
    for name, f in result.get("failures", {}).items():
        for what, n in f["errors"].items():
            print(f"failed {name}: {n} x {what}")
        for what, n in f.get("control_retries", {}).items():
            print(f"retried {name} rollout create/finish: {n} x {what}")
        for one in f["first_failures"]:
            if "calls_in_store" in one:
                print(f"  {one['url']}: stream={one['stream']}, {one['seconds']} s, "
                      f"{one['calls_in_store']} of the rollout's 2 calls in the store: {one['error']}")
    for name, m in result["memory"].items():
        print(f"anon   {name:>14}: first {m['first']:.0f}, after warm-up {m['after_warmup']:.0f}, "
              f"end {m['end']:.0f}, peak {m['peak']:.0f} MiB, growth {m['growth']:+.1f} MiB "
              f"over the last {m['measured_s']:.0f} s")
    for name, m in result["memory_rss"].items():
        print(f"rss    {name:>14}: after warm-up {m['after_warmup']:.0f}, end {m['end']:.0f}, "
              f"peak {m['peak']:.0f} MiB, growth {m['growth']:+.1f} MiB (pg: PSS)")
