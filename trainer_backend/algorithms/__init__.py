"""Advantages and losses: one module per algorithm (rollout-level GRPO today)."""
