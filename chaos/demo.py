"""The demo cluster: a coordinator and synthetic learners, through a crash.

Starts one coordinator and M learners as local processes, SIGKILLs the
coordinator part-way through and restarts it on the same state directory,
lets the learners finish, and checks what a user cares about: every
contribution a learner pushed was merged or dropped with a reason, the
committed versions survived the crash, and the held-out loss went down.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos.local import CoordinatorProcess


@dataclass(frozen=True)
class DemoSettings:
    learners: int = 4
    task: str = "lm-stdlib"
    size: str = "small"
    steps: int = 600
    kill_after_s: float = 15.0
    down_s: float = 1.5
    out: Path = Path("runs/demo")
    coordinator_args: tuple[str, ...] = (
        "--set", "policy.grace_max_s=0.5", "--set", "outer.lr=0.3",
        "--set", "outer.momentum=0.0")


def run_demo(settings: DemoSettings) -> int:
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    state = out / "state"
    if state.exists():
        for old in sorted(state.rglob("*"), reverse=True):
            old.unlink() if old.is_file() else old.rmdir()
    coordinator = CoordinatorProcess(
        state_dir=state, args=[*settings.coordinator_args,
                               "--event-log", str(out / "coordinator.events.jsonl")])
    coordinator.start()
    print(f"coordinator listening on {coordinator.address} (state in {state})", flush=True)
    learners = [
        subprocess.Popen(
            [sys.executable, "-m", "learner", "--coordinator", coordinator.address,
             "--learner-id", f"learner-{i}", "--task", settings.task, "--size", settings.size,
             "--shard", str(i), "--num-shards", str(settings.learners),
             "--steps", str(settings.steps), "--progress-every", "100",
             "--event-log", str(out / f"learner-{i}.events.jsonl")],
            stdout=subprocess.PIPE, text=True)
        for i in range(settings.learners)]
    try:
        time.sleep(settings.kill_after_s)
        before = coordinator.status()
        versions_before = {f.fragment: f.version for f in before.fragments}
        coordinator.kill()
        print(f"SIGKILLed the coordinator at versions {versions_before}", flush=True)
        time.sleep(settings.down_s)
        coordinator.start()
        after = coordinator.status()
        versions_after = {f.fragment: f.version for f in after.fragments}
        print(f"restarted it; it resumed at versions {versions_after}", flush=True)
        summaries = []
        for process in learners:
            stdout, _ = process.communicate(timeout=600)
            for line in stdout.splitlines():
                if line.startswith("{"):
                    summaries.append(json.loads(line))
                else:
                    print(line, flush=True)
        final = coordinator.status()
    finally:
        for process in learners:
            if process.poll() is None:
                process.kill()
        coordinator.stop()
    return _report(summaries, versions_before, versions_after, final, out)


def exactly_once(out: Path) -> tuple[int, list[str], list[str]]:
    """(merged count, ids merged twice, acknowledged ids neither merged nor dropped),
    from the durable manifest log and the learners' event logs."""
    merged: dict[tuple[str, int, int], int] = {}
    for line in (out / "state" / "manifests.jsonl").read_text().splitlines():
        record = json.loads(line)
        for c in record["manifest"]:
            key = (c["learner"], record["fragment"], c["seq"])
            merged[key] = merged.get(key, 0) + 1
    acked: set[tuple[str, int, int]] = set()
    dropped: set[tuple[str, int, int]] = set()
    for log in out.glob("learner-*.events.jsonl"):
        for line in log.read_text().splitlines():
            event = json.loads(line)
            key = (event.get("learner", ""), event.get("fragment", -1), event.get("seq", -1))
            if event["kind"] == "push_ack":
                acked.add(key)
            elif event["kind"] == "dropped":
                dropped.add(key)
    twice = [f"{k}" for k, n in merged.items() if n > 1]
    lost = [f"{k}" for k in sorted(acked - set(merged) - dropped)]
    return len(merged), twice, lost


def _report(summaries: list[dict[str, Any]], before: dict[int, int], after: dict[int, int],
            final: Any, out: Path) -> int:
    print("\nlearner      eval loss start -> end   merged  dropped  re-pushed    backlog")
    for s in summaries:
        print(f"{s['learner']:<12} {s['eval_loss_start']:>9.4f} -> {s['eval_loss_end']:<9.4f} "
              f"{s['merged']:>7} {sum(s['dropped'].values()):>8} {s['repushed']:>10} "
              f"{s['backlog']:>10}")
    merged, twice, lost = exactly_once(out)
    print(f"\n{merged} contributions merged; merged twice: {twice or 'none'}; "
          f"acknowledged but lost: {lost or 'none'}")
    checks = {
        "no contribution merged twice": not twice,
        "every acknowledged contribution merged or dropped with a reason": not lost,
        "every learner finished": len(summaries) > 0 and all(s["steps"] > 0 for s in summaries),
        "committed versions survived the crash": all(
            after.get(p, -1) >= v for p, v in before.items()),
        "training went on after the restart": all(
            f.version > before.get(f.fragment, 0) for f in final.fragments),
        "held-out loss went down on every learner": all(
            s["eval_loss_end"] < s["eval_loss_start"] for s in summaries),
    }
    print()
    for name, ok in checks.items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")
    verdict = all(checks.values())
    (out / "summary.json").write_text(json.dumps(
        {"learners": summaries, "versions_before_kill": before, "versions_after_restart": after,
         "final_versions": {f.fragment: f.version for f in final.fragments},
         "checks": checks, "passed": verdict}, indent=2))
    print(f"\n{'all checks passed' if verdict else 'some checks FAILED'}; "
          f"summary and event logs in {out}/")
    return 0 if verdict else 1
