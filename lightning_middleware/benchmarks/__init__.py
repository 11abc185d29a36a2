"""Benchmarks no one here wrote, as task sources: each turns an address into tasks and scores an
answer with the benchmark's own scorer, never a re-implementation of it.

- `reasoning` (reasoning-gym, the `benchmarks` extra): `rg:NAME?size=500&seed=1&KEY=VALUE`, the
  procedural dataset NAME with its own config keys; its score is the reward rule
  `lightning_middleware.benchmarks.reasoning:rg_score`.
- `bfcl` (bfcl-eval, installed with `--no-deps` by the set-up): `bfcl:CATEGORY?split=test`, BFCL's
  single-turn function-calling items with its functions as tools; its AST checker is the reward
  rule `lightning_middleware.benchmarks.bfcl:bfcl_score`.

Rules go in a reward configuration (docs/rewards.md), usually with `agent_reward = false`.
`controller.tasks.load_tasks` (and so `lightning-mw rollouts --tasks`) reads these addresses
through `tasks_from`.
"""

from __future__ import annotations

from typing import Any

SCHEMES = ("rg", "bfcl")


def is_address(source: object) -> bool:
    return isinstance(source, str) and source.split(":", 1)[0] in SCHEMES and ":" in source


def tasks_from(address: str) -> list[dict[str, Any]]:
    """The tasks a benchmark address names (`rg:...` or `bfcl:...`)."""
    scheme = address.split(":", 1)[0]
    if scheme == "rg":
        from lightning_middleware.benchmarks import reasoning

        return reasoning.tasks(address)
    if scheme == "bfcl":
        from lightning_middleware.benchmarks import bfcl

        return bfcl.tasks(address)
    raise ValueError(f"not a benchmark address: {address!r} (schemes: {', '.join(SCHEMES)})")
