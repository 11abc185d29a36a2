"""The heavy side: batch building, GRPO loss, training engines, weight publishing."""

import os as _os
import sys as _sys

# torch's OpenMP threads (libgomp) spin at every barrier by default: on a machine shared with a
# vLLM server or other work, a spinning thread holds the core that its peer needs and each of the
# thousands of parallel ops in a training step waits a scheduler slice. Measured on the 2-core
# machine under load: a LoRA step of SmolLM2-135M's shape took 115 s with spinning threads, 10 s
# passive; on a quiet machine passive cost 10-35% in one A/B (docs/benchmarks.md). libgomp reads
# this when it loads, so only before torch is imported; the user's OMP_WAIT_POLICY or GOMP_SPINCOUNT
# wins.
OMP_WAIT_DEFAULTED = ("torch" not in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ
                      and "GOMP_SPINCOUNT" not in _os.environ)
if OMP_WAIT_DEFAULTED:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
