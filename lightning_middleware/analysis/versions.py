"""Two reward versions side by side: the same rollouts' final rewards under two reward
configurations (a rescore's new version against the old one, or against the agent's own
reward), their distributions and where they disagree.

A version is a configuration's hash (`lightning-mw rewards check` prints it): its final reward
of a rollout is the latest reward named "final" under that hash (stored beside the rollout's
`final_reward` or applied to it). `AGENT` ("agent") names the agent's own reward, the version
before any configuration. Disagreement that matters to GRPO is within a group (the rollouts of
one task and mode): a pair of rollouts the two versions order oppositely is discordant, and
each rollout's `discordant` counts its partners in such pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_middleware.analysis.frames import load_rewards, load_rollouts
from lightning_middleware.store import TraceStore, open_store

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure

AGENT = "agent"  # the version of the agent's own reward (no configuration)
FINAL = "final"  # the combined reward's name (rewards.combine)
_SKIP = ("human", "protected_files", FINAL, "reward_errors")  # not the agent's own final reward


def _finals(rewards: pd.DataFrame) -> pd.DataFrame:
    """Per (version, rollout) the latest final reward and its components: version, rollout_id,
    value, components, created_at."""
    import pandas as pd

    configured = rewards[(rewards["name"] == FINAL) & rewards["config_hash"].notna()].assign(
        version=lambda d: d["config_hash"])
    own = rewards[rewards["config_hash"].isna() & rewards["final"] & rewards["call_index"].isna()
                  & rewards["agent"].isna() & ~rewards["name"].isin(_SKIP)].assign(version=AGENT)
    both = pd.concat([configured, own]).sort_values("id")
    latest = both.groupby(["version", "rollout_id"], as_index=False).last()
    latest["components"] = [(m or {}).get("components", {}) if v != AGENT else {}
                            for m, v in zip(latest["metadata"], latest["version"])]
    return latest[["version", "rollout_id", "value", "components", "created_at"]]


def reward_versions(store: TraceStore | str | None = None) -> pd.DataFrame:
    """One row per reward version stored: n_rollouts, mean, std, min, max, first_at, last_at,
    components (the names combined), newest last. `AGENT` is the agents' own reward."""
    import pandas as pd

    finals = _finals(load_rewards(open_store(store)))
    if finals.empty:
        return pd.DataFrame(columns=["n_rollouts", "mean", "std", "min", "max", "first_at", "last_at",
                                     "components"]).rename_axis("version")
    g = finals.groupby("version")
    out = pd.DataFrame({"n_rollouts": g.size(), "mean": g["value"].mean(), "std": g["value"].std(),
                        "min": g["value"].min(), "max": g["value"].max(), "first_at": g["created_at"].min(),
                        "last_at": g["created_at"].max(),
                        "components": g["components"].agg(lambda s: sorted({k for d in s for k in d}))})
    return out.sort_values("last_at")


@dataclass(frozen=True)
class RewardComparison:
    """`frame`: one row per rollout with a final reward under both versions: rollout_id, task_id,
    mode, final_a, final_b, diff (b - a), rank_a, rank_b (in its group, 1 = best, ties share
    their mean rank), rank_shift (rank_b - rank_a), group_size, discordant (group partners the
    two order oppositely), components_a, components_b. `summary`: the counts and statistics."""

    version_a: str
    version_b: str
    frame: pd.DataFrame
    summary: dict[str, Any]

    def disagreements(self, n: int = 10) -> pd.DataFrame:
        """The `n` rollouts the versions disagree on most: most discordant pairs, then largest |diff|."""
        f = self.frame.assign(abs_diff=self.frame["diff"].abs())
        return f.sort_values(["discordant", "abs_diff"], ascending=False).head(n).drop(columns="abs_diff")

    def figure(self) -> Figure:
        """The two distributions side by side, and a scatter of a against b (discordant rollouts marked)."""
        import matplotlib.pyplot as plt

        f = self.frame
        fig, (hist, scatter) = plt.subplots(1, 2, figsize=(11, 4))
        a, b = _short(self.version_a), _short(self.version_b)
        hist.hist([f["final_a"], f["final_b"]], bins=20, label=[a, b])
        hist.set_xlabel("final reward")
        hist.set_ylabel("rollouts")
        hist.set_title("distributions")
        hist.legend()
        flips = f["discordant"] > 0
        scatter.scatter(f.loc[~flips, "final_a"], f.loc[~flips, "final_b"], s=14, label="same order in group")
        scatter.scatter(f.loc[flips, "final_a"], f.loc[flips, "final_b"], s=14, c="tab:red",
                        label="order flipped in group")
        scatter.set_xlabel(f"final reward, {a}")
        scatter.set_ylabel(f"final reward, {b}")
        rho = self.summary.get("spearman")
        scatter.set_title("per rollout" + ("" if rho is None else f" (Spearman {rho:.2f})"))
        scatter.legend(fontsize="small")
        fig.tight_layout()
        return fig


def _short(version: str) -> str:
    return version if version == AGENT else version[:8]


def compare_reward_versions(store: TraceStore | str | None = None, version_a: str | None = None,
                            version_b: str | None = None) -> RewardComparison:
    """Compare the final rewards of two versions (default: the two newest; `AGENT` is the agent's
    own reward) over the rollouts that have both. ValueError names the stored versions if one of
    them has no final reward."""
    st = open_store(store)
    finals = _finals(load_rewards(st))
    stored = list(finals.groupby("version")["created_at"].max().sort_values().index)
    a, b = _pick(version_a, version_b, stored)
    frame = _frame(st, finals, a, b)
    return RewardComparison(a, b, frame, _summary(finals, frame, a, b))


def _pick(a: str | None, b: str | None, stored: list[str]) -> tuple[str, str]:
    """The versions to compare: those given; for one not given, the newest other one."""
    for v in (a, b):
        if v is not None and v not in stored:
            raise ValueError(f"no final rewards under reward version {v!r}; stored versions: {stored}")
    others = [v for v in stored if v not in (a, b)]
    missing = (a is None) + (b is None)
    if len(others) < missing:
        raise ValueError(f"comparing needs two reward versions, the store has {len(stored)} ({stored}); "
                         "make a second one with `lightning-mw rewards rescore --config ...`")
    if b is None:
        b = others.pop()
    if a is None:
        a = others.pop()
    return a, b


def _frame(store: TraceStore, finals: pd.DataFrame, a: str, b: str) -> pd.DataFrame:
    fa = finals[finals["version"] == a].set_index("rollout_id")
    fb = finals[finals["version"] == b].set_index("rollout_id")
    rollouts = load_rollouts(store)[["rollout_id", "task_id", "mode"]].set_index("rollout_id")
    f = rollouts.join(fa[["value", "components"]].rename(columns={"value": "final_a", "components": "components_a"}),
                      how="inner")
    f = f.join(fb[["value", "components"]].rename(columns={"value": "final_b", "components": "components_b"}),
               how="inner").reset_index()
    f["diff"] = f["final_b"] - f["final_a"]
    group = f.groupby(["task_id", "mode"])
    f["rank_a"] = group["final_a"].rank(method="average", ascending=False)
    f["rank_b"] = group["final_b"].rank(method="average", ascending=False)
    f["rank_shift"] = f["rank_b"] - f["rank_a"]
    f["group_size"] = group["rollout_id"].transform("size")
    f["discordant"] = 0
    for _, g in group:
        f.loc[g.index, "discordant"] = _discordant(g)
    return f[["rollout_id", "task_id", "mode", "final_a", "final_b", "diff", "rank_a", "rank_b", "rank_shift",
              "group_size", "discordant", "components_a", "components_b"]]


def _discordant(g: pd.DataFrame) -> Any:
    """Per rollout of a group: the partners the two versions order oppositely."""
    import numpy as np

    a, b = g["final_a"].to_numpy(), g["final_b"].to_numpy()
    flips = np.sign(a[:, None] - a[None, :]) * np.sign(b[:, None] - b[None, :]) < 0
    return flips.sum(axis=1)


def _best_changed(f: pd.DataFrame) -> int:
    """Groups (of two or more) where no rollout best under a is also best under b."""
    n = 0
    for _, g in f.groupby(["task_id", "mode"]):
        if len(g) > 1:
            best_a = set(g.loc[g["rank_a"] == g["rank_a"].min(), "rollout_id"])
            n += not best_a & set(g.loc[g["rank_b"] == g["rank_b"].min(), "rollout_id"])
    return n


def _summary(finals: pd.DataFrame, f: pd.DataFrame, a: str, b: str) -> dict[str, Any]:
    n_a = int((finals["version"] == a).sum())
    n_b = int((finals["version"] == b).sum())
    pairs = int(sum(n * (n - 1) // 2 for n in f.groupby(["task_id", "mode"]).size()))
    flipped = int(f["discordant"].sum() // 2)
    return {
        "version_a": a, "version_b": b, "n_a": n_a, "n_b": n_b, "n_both": len(f),
        "only_a": n_a - len(f), "only_b": n_b - len(f),
        "mean_a": _num(f["final_a"].mean()), "mean_b": _num(f["final_b"].mean()),
        "mean_diff": _num(f["diff"].mean()), "mean_abs_diff": _num(f["diff"].abs().mean()),
        "pearson": _corr(f, "pearson"), "spearman": _corr(f, "spearman"),
        "groups": int(f.groupby(["task_id", "mode"]).ngroups), "pairs": pairs, "discordant_pairs": flipped,
        "discordant_rate": flipped / pairs if pairs else None, "groups_best_changed": _best_changed(f),
    }


def _num(x: Any) -> float | None:
    return None if x != x else float(x)  # NaN (no rows) -> None


def _corr(f: pd.DataFrame, method: str) -> float | None:
    if len(f) < 2 or f["final_a"].nunique() < 2 or f["final_b"].nunique() < 2:
        return None  # constant input: no ordering to agree on
    a, b = f["final_a"], f["final_b"]
    if method == "spearman":  # Pearson's of the ranks (pandas' own spearman needs scipy)
        a, b = a.rank(), b.rank()
    return float(a.corr(b))
