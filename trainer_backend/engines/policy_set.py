"""What every engine of several policies shares, whatever trains each policy: rows routed by
`Row.policy`, one step updating each policy that has rows, metrics per policy, one version.

    step(rows)   each policy trains on its own rows (`Row.policy`: the served model name the
                 calls went to); one step may update several policies. Rows of a model that is
                 not one of the policies go to `default` if set, else are left out (counted).
    save(out)    one adapter folder per policy, `out/<policy>/`, each loadable by vLLM; the
                 publisher loads them all in place in one pause.

`policy_version` counts the set's steps: it is what the served weights are tagged with and what
rollouts are stamped with, so staleness is in steps, as with one policy. Each policy's own
update count is in its metrics (`<policy>/updates`).

The torch engine's set (`engines/policies.py`) puts every policy on one peft model; the verl
engine's (`engines/verl_policies.py`) gives each policy its own verl engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from lightning_middleware.rows import Row
from trainer_backend.engines.base import Engine

# how each policy's metric becomes the step's: the worst (health checks look at it), the sum, else the mean
_WORST = ("grad_norm", "approx_kl", "kl_ref", "ratio_max", "clip_frac", "clip_frac_lower", "behaviour_logprob_gap")
_SUMMED = ("rows", "rollouts", "micro_batches", "tokens", "padded_tokens", "response_tokens", "time_s", "pairs")


def check_names(names: Sequence[str], default: str | None) -> None:
    """Policies are distinct names; the default policy, when set, is one of them."""
    if not names or len(set(names)) != len(names):
        raise ValueError(f"policies must be distinct names, got {list(names)}")
    if default is not None and default not in names:
        raise ValueError(f"default policy {default!r} is not one of {list(names)}")


class MultiPolicy:
    """The `Engine` (and `RoutesRows`) surface over one engine per policy, `engines`.

    A subclass builds `engines` (each an `Engine` that trains one policy) and says how many
    updates a policy has had (`updates`)."""

    names: tuple[str, ...]
    default: str | None
    policy_version: int
    engines: Mapping[str, Engine]

    def updates(self, name: str) -> int:
        """How many optimizer updates policy `name` has had (resumes included)."""
        raise NotImplementedError

    def stepped(self, name: str) -> None:
        """Called after policy `name`'s engine has stepped (a set that counts updates itself counts here)."""

    def route(self, rows: Sequence[Row]) -> dict[str, list[Row]]:
        """Rows by the policy that trains them (rows of no policy, without a default, are left out)."""
        out: dict[str, list[Row]] = {}
        for row in rows:
            name = row.policy if row.policy in self.engines else self.default
            if name is not None:
                out.setdefault(name, []).append(row)
        return out

    def step(self, rows: Sequence[Row]) -> dict[str, float]:
        routed = self.route(rows)
        if not routed:
            raise ValueError(f"no row belongs to a policy of {list(self.names)} (rows' models: "
                             f"{sorted({str(r.policy) for r in rows})}) and there is no default policy")
        per_policy = {}
        for name, policy_rows in routed.items():
            per_policy[name] = self.engines[name].step(policy_rows)
            self.stepped(name)
        self.policy_version += 1
        metrics = combine(per_policy)
        for name, m in per_policy.items():
            metrics.update({f"{name}/{k}": v for k, v in m.items()})
            metrics[f"{name}/updates"] = float(self.updates(name))
        metrics["policies_updated"] = float(len(per_policy))
        metrics["rows_unrouted"] = float(len(rows) - sum(len(r) for r in routed.values()))
        metrics["policy_version"] = float(self.policy_version)
        return metrics

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        for name, engine in self.engines.items():
            engine.save(out / name)
        return out


def combine(per_policy: dict[str, dict[str, float]]) -> dict[str, float]:
    """The step's metrics from each policy's: the worst, the sum or the mean (see above)."""
    keys = set.intersection(*(set(m) for m in per_policy.values()))
    out = {}
    for k in keys:
        values = [m[k] for m in per_policy.values() if isinstance(m[k], (int, float)) and not math.isnan(m[k])]
        if not values:
            continue
        out[k] = max(values) if k in _WORST or k.endswith("_max") else sum(values) if k in _SUMMED \
            else sum(values) / len(values)
    return out
