"""Training engines behind the `Engine` protocol: an in-process PyTorch engine (one machine,
CPU or one GPU) and verl (GPU clusters); the precision choice both use."""
