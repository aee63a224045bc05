"""`bench.replication` runs (small) to its JSON line, its three series included:
gRPC chunks, the bulk channel, and the bulk channel with an all-zero momentum left
out, each of which the standby must acknowledge for the run to finish."""

from __future__ import annotations

import json
import subprocess
import sys


def test_replication_bench_small_runs_to_its_json_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.replication", "--params", "400000", "--fragments", "2",
         "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["name"] == "replication" and result["target"] == 1.0
    assert result["ratio"] > 0 and result["zero_momentum_speedup"] > 0
    assert set(result["round_s"]) == {"grpc", "bulk", "bulk_zero_momentum"}
