"""The learner written from docs/protocol.md alone (learner/examples/minimal_learner.py)
joins a run beside two `ftsync-learner --task synthetic` processes on a real daemon:
its contributions are merged (the coordinator's commit manifests name them, and
Admin.Status counts them), and the built-in learners apply versions it helped make.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.daemon import Daemon, wait_until

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = ROOT / "learner" / "examples" / "minimal_learner.py"
STEPS = ("--steps", "240", "--sync-every", "20")


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_it_imports_nothing_of_ftsync_but_the_generated_stubs() -> None:
    imported: set[str] = set()
    for node in ast.walk(ast.parse(MINIMAL.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    ours = {name for name in imported
            if name.split(".")[0] in ("protos", "learner", "coordinator", "chaos")}
    assert ours == {"protos.ftsync_pb2", "protos.ftsync_pb2_grpc"}, ours
    assert {name.split(".")[0] for name in imported} - {"protos"} <= {
        "__future__", "argparse", "hashlib", "itertools", "json", "sys", "time",
        "collections", "pathlib", "typing", "grpc", "numpy"}


def test_the_minimal_learner_merges_beside_built_in_ones(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    log = tmp_path / "coordinator.jsonl"
    daemon = start_daemon("--set", "policy.grace_max_s=0.5", "--set", "outer.lr=0.3",
                          "--set", "outer.momentum=0.0", "--event-log", str(log))
    built_in = [subprocess.Popen(
        [sys.executable, "-m", "learner", "--coordinator", daemon.address,
         "--learner-id", f"builtin-{i}", "--task", "synthetic", "--dim", "1024",
         "--fragments", "4", "--shard", str(i), "--num-shards", "3", *STEPS,
         "--step-ms", "10", "--event-log", str(tmp_path / f"builtin-{i}.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for i in range(2)]
    # The built-in learners take seconds to import torch, the minimal one none: it
    # starts once they are training (each has pushed), so that their runs overlap
    # however long a busy machine takes to start them.
    wait_until(lambda: sum(lr.contributions > 0 for lr in daemon.status().learners
                           if lr.learner_id.startswith("builtin-")) == 2, timeout=120,
               message="the built-in learners pushing")
    minimal = subprocess.Popen(
        [sys.executable, str(MINIMAL), "--coordinator", daemon.address,
         "--learner-id", "minimal", "--shard", "2", *STEPS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        out, _ = minimal.communicate(timeout=240)
        assert minimal.returncode == 0, out
        summary = json.loads(out.strip().splitlines()[-1])
        outputs = [p.communicate(timeout=240)[0] for p in built_in]
        for process, output in zip(built_in, outputs, strict=True):
            assert process.returncode == 0, output
    finally:
        for process in (minimal, *built_in):
            if process.poll() is None:
                process.kill()
                process.wait()

    assert summary["pushed"] > 0 and summary["merged"] > 0, summary
    assert set(summary["refused"]) <= {"stale"}, summary
    assert summary["eval_loss_end"] < 0.5 * summary["eval_loss_start"], summary
    status = {lr.learner_id: lr for lr in daemon.status().learners}
    assert status["minimal"].contributions == summary["pushed"]
    # The versions the minimal learner's contributions went into...
    helped = {(e["fragment"], e["version"]) for e in events(log) if e["kind"] == "commit"
              and any(c["learner"] == "minimal" for c in e["manifest"])}
    assert helped, "no commit manifest names the minimal learner"
    # ... merged beside the built-in learners' contributions, and applied by them.
    beside = {(e["fragment"], e["version"]) for e in events(log) if e["kind"] == "commit"
              and any(c["learner"].startswith("builtin-") for c in e["manifest"])}
    for i in range(2):
        applied = {(e["fragment"], e["version"])
                   for e in events(tmp_path / f"builtin-{i}.jsonl") if e["kind"] == "applied"}
        assert applied & helped, f"builtin-{i} applied none of {sorted(helped)}"
    assert beside, "the built-in learners' contributions were never merged"
    # And the minimal learner applied versions the built-in ones made.
    assert {tuple(pair) for pair in summary["applied"]} & beside


def test_the_minimal_learner_rides_out_a_coordinator_restart(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """Killed once the first version it helped make is committed, the coordinator
    restarts on its state directory: the minimal learner's calls meanwhile wait, the
    first one after is refused `unknown_learner`, and it joins again, pushes again what
    was not merged and trains to the end, its later contributions merged too."""
    log = tmp_path / "coordinator.jsonl"
    daemon = start_daemon("--set", "policy.grace_max_s=0", "--set", "outer.lr=0.3",
                          "--set", "outer.momentum=0.0", "--event-log", str(log))
    minimal = subprocess.Popen(
        [sys.executable, str(MINIMAL), "--coordinator", daemon.address,
         "--learner-id", "minimal", "--steps", "2000", "--sync-every", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)

    def merged_minimal() -> bool:
        return log.exists() and any(
            e["kind"] == "commit" and any(c["learner"] == "minimal" for c in e["manifest"])
            for e in events(log))
    try:
        wait_until(merged_minimal, timeout=60, message="a commit naming the minimal learner")
        daemon.kill()
        daemon.start()
        out, _ = minimal.communicate(timeout=240)
    finally:
        if minimal.poll() is None:
            minimal.kill()
            minimal.wait()
    assert minimal.returncode == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert set(summary["refused"]) <= {"stale"}, summary
    after = events(log)
    resumed = next(i for i, e in enumerate(after) if e["kind"] == "resume")
    assert [e["learner"] for e in after[resumed:] if e["kind"] == "join"] == ["minimal"]
    assert any(e["kind"] == "commit" and any(c["learner"] == "minimal" for c in e["manifest"])
               for e in after[resumed:]), "nothing of the minimal learner merged after"
    assert summary["eval_loss_end"] < 0.5 * summary["eval_loss_start"], summary
