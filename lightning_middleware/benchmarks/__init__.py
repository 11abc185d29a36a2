"""Benchmarks no one here wrote, as task sources: each turns an address into tasks and scores an
answer with the benchmark's own scorer, never a re-implementation of it.

`reasoning` (reasoning-gym, the `benchmarks` extra): `rg:NAME?size=500&seed=1&KEY=VALUE`, the
procedural dataset NAME with its own config keys; its score is the reward rule
`lightning_middleware.benchmarks.reasoning:rg_score` in a reward configuration (docs/rewards.md).
`controller.tasks.load_tasks` (and so `lightning-mw rollouts --tasks`) reads these addresses.
"""
