"""The README's main job, as a user runs it (smaller)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_trains_through_a_coordinator_crash(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "chaos", "demo", "--learners", "3", "--size", "tiny",
         "--steps", "800", "--kill-after", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SIGKILLed the coordinator" in result.stdout
    assert "all checks passed" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and len(summary["learners"]) == 3
    assert all(summary["checks"].values())


def test_demo_rejects_bad_flags() -> None:
    result = subprocess.run([sys.executable, "-m", "chaos", "demo", "--learners", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--learners" in result.stderr
