"""`bench.transfer` runs (small, over plaintext and mutual TLS) to its JSON line: its
own check that version 1 is the daemon's outer step of the pushed gradient once went
stale against a changed default, and nothing ran it."""

from __future__ import annotations

import json
import subprocess
import sys


def test_transfer_bench_small_runs_to_its_json_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.transfer", "--params", "2000000", "--rounds", "1",
         "--codec-rounds", "1", "--raw-repeats", "1", "--tls"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["name"] == "transfer" and result["target"] == 0.7
    assert result["ratio"] > 0 and result["tls_ratio"] > 0
    # The raw socket over TLS ran with the bulk port's contexts, and echoed intact.
    assert result["tls_socket_ratio"] > 0 and result["tls_socket"]["bytes_up"] == 8_000_000
    assert set(result["codecs"]) == {"fp32", "bf16", "int8", "e3m0"}
