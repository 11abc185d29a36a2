"""lightning-middleware: record what your agent's LLM calls do, train on it with RL."""
