"""Training from stored datasets instead of live rollouts (offline DPO)."""
