"""`bench.adaptive` runs, quick, to its JSON line: a static quorum and `auto` through a
real daemon and four learner processes, then fixed H against `sync_every = "auto"`.
Nothing else runs the benchmark, so a change in the learners' progress lines, the event
log's commit records or the figures' reading would otherwise go unseen until its next
full run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_adaptive_bench_quick_runs_to_its_json_line() -> None:
    run = subprocess.run([sys.executable, "-m", "bench.adaptive", "--quick", "--only", "quiet"],
                         capture_output=True, text=True, timeout=380)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["name"] == "adaptive" and result["repeats"] == 1
    assert result["task"] == "lm-stdlib" and result["settings"] == []
    quiet = result["scenarios"]["quiet"]
    assert set(quiet["time_to_target_s"]) == {"1", "auto"}
    # The target is the best static run's final loss + 2%: that run reaches it.
    assert quiet["reached"]["1"] == 1, quiet
    assert result["auto_k_vs_best_static"] > 0 and result["auto_k_best_gain"] > 0
    assert sum(quiet["auto_rounds_by_quorum"].values()) > 0, quiet
    local = result["local_steps"]
    assert result["auto_h_loss_ratio"] > 0 and result["auto_h_staleness_ratio"] >= 0
    # The automatic H reached every learner, within [h_min, h_max].
    (assigned,) = local["assigned"]
    assert len(assigned) == 4 and all(2 <= h <= 20 for h in assigned.values()), assigned


@pytest.mark.parametrize(("flags", "said"), [
    (["--repeats", "0"], "--repeats must be odd and at least 1, so that a median is one "
                         "run's figure (got 0)"),
    (["--repeats", "2"], "(got 2)"),
    (["--only", "quiet,loud"], "--only takes heterogeneous, noisy, quiet; unknown: loud"),
    (["--parts", "quorum,speed"], "--parts takes quorum and local_steps; unknown: speed"),
    (["--set", "outer.lr"], "--set expects KEY=VALUE, got 'outer.lr'"),
    (["--set", "outer.speed=2"], "outer.speed"),
])
def test_bad_options_are_refused_before_any_run(flags: list[str], said: str) -> None:
    run = subprocess.run([sys.executable, "-m", "bench.adaptive", *flags],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and said in run.stderr, run.stderr
