"""bench/bench_gateway.py, short: it runs as its docs say, and every target's calls were made.

The figures are in docs/benchmarks.md ("Gateway"); this guards the script: its table (two
concurrency levels, a target that refuses streams) and that the gateway recorded each call.
The reference implementation's target (`--agl-python`, bench_gateway_vs_agl.py) needs Python
>= 3.12 and agentlightning from PyPI, so it is not run here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gateway_prints_every_target_at_each_concurrency() -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "bench_gateway.py"), "--seq", "5", "--conc", "2,4",
           "--conc-requests", "12", "--max-seconds", "5"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for mode in ("non-stream", "stream"):
        for label in ("p50 ms, sequential", "req/s, 2 concurrent", "req/s, 4 concurrent", "p99 ms, 4 concurrent"):
            row = [line for line in lines if line.startswith(mode.ljust(10)) and label in line]
            assert len(row) == 1, (mode, label, out.stdout)
            assert "refused" not in row[0]  # direct, the floor and our gateway all serve streams
    # Every gateway call is recorded. Per mode: a warm-up and 5 sequential calls, then each
    # concurrent phase's warm-up (one a caller) and its 12 calls; and the one stream request that
    # asks whether the gateway refuses streams.
    recorded = re.search(r"recorded llm_calls: (\d+) \(training: (\d+)\)", out.stdout)
    assert recorded is not None, out.stdout
    assert int(recorded.group(1)) == int(recorded.group(2)) == 2 * ((1 + 5) + (2 + 12) + (4 + 12)) + 1
