"""The heavy side: batch building, GRPO loss, training engines, weight publishing."""

import os as _os
import sys as _sys

# torch's OpenMP threads (libgomp) spin at every barrier by default: on a machine shared with a
# vLLM server or other work, a spinning thread holds the core that its peer needs and each of the
# thousands of parallel ops in a training step waits a scheduler slice (the measurements:
# docs/benchmarks.md, "spinning OpenMP threads"). libgomp reads this when it loads, so only before
# torch is imported; the user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
OMP_WAIT_DEFAULTED = ("torch" not in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ
                      and "GOMP_SPINCOUNT" not in _os.environ)
if OMP_WAIT_DEFAULTED:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
