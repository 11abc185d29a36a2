"""The trainer daemon: poll the store, build rollout-level batches, train, publish, commit."""
