"""Serving benchmark: a training peer's step rate while it serves catch-ups, against its
rate in the quiet spells between them, both measured in one run.

A real daemon (fsync off) and a peer learner process (the
`tests.integration.learner_worker` model, 50M parameters in 4 fragments: 200 MB) that
trains with steps of 50 ms of waiting (an accelerator step) plus a little CPU, serving
its fragments to peers. It syncs every 1000 steps (50 s, as DiLoCo's H of hundreds of
steps does), so its own pushes stay out of the measurement. A second learner process
catches up from it again and again, each catch-up a fresh `Learner`, with quiet spells
of `--gap-s` between them: a change in the machine's load reaches both kinds of window
alike. The figure is the peer's steps per second within the catch-ups over its steps
per second between them (from 0.1 s after a catch-up ends to the next one's start).

Every process shares this machine's cores; in a deployment the learner catching up and
the coordinator run on other hosts, so here they run at the lowest priority (`--nice`,
default 19) and take a core only when the peer does not want it. What the peer spends
serving (its loop, its kernel copies) counts in full. On a machine busy with other work
at normal priority, processes at nice 19 get next to nothing: `--nice 0` there.

Run from the repository root: `python -m bench.serving [--params N] [--catch-ups K]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.catchup import ROOT, WORKER, log
from chaos.local import CoordinatorProcess as Daemon

TARGET = 0.9
STEP_MS = 50
# After a catch-up ends, its last frames may still be leaving the peer's socket.
SETTLE_S = 0.1


def rate(steps: np.ndarray, windows: list[tuple[float, float]]) -> float:
    """Steps ended within `windows`, per second of them."""
    count = sum(int(((steps > a) & (steps <= b)).sum()) for a, b in windows)
    return count / sum(b - a for a, b in windows)


def json_line(process: subprocess.Popen[str]) -> dict[str, Any]:
    """The worker's next JSON line; a worker that exits first fails the run."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("{"):
            record: dict[str, Any] = json.loads(line)
            return record
    raise RuntimeError(f"learner worker {process.pid} exited ({process.wait()}) "
                       f"before saying what it did")


def measure_serving(params: int = 50_000_000, fragments: int = 4, catch_ups: int = 14,
                    gap_s: float = 0.8, nice: int = 19) -> dict[str, Any]:
    """The benchmark; returns the JSON line's object."""
    size = ["--params", str(params), "--fragments", str(fragments), "--sync-every", "1000"]
    log(f"{params:,} parameters in {fragments} fragments, {catch_ups} catch-ups "
        f"{gap_s} s apart; load average {os.getloadavg()[0]:.2f}")
    started: list[subprocess.Popen[str]] = []

    def worker(*args: str, nice: int = 0) -> subprocess.Popen[str]:
        process = subprocess.Popen([*WORKER, *args], cwd=ROOT, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                   preexec_fn=(lambda: os.nice(nice)) if nice else None)
        started.append(process)
        return process

    with tempfile.TemporaryDirectory(prefix="ftsync-bench-serving-") as tmp:
        daemon = Daemon(state_dir=Path(tmp) / "state",
                        args=["--set", "fsync=false", "--set", "policy.grace_max_s=0"])
        daemon.start()
        try:
            assert daemon.process is not None
            os.setpriority(os.PRIO_PROCESS, daemon.process.pid, nice)
            peer = worker("train", "--coordinator", daemon.address, "--learner-id", "peer",
                          *size, "--step-ms", str(STEP_MS), "--serve-peers", "127.0.0.1:0")
            peer_address = json_line(peer)["peer_address"]
            late = worker("catchup", "--coordinator", daemon.address, "--learner-id", "late",
                          *size, "--peers", peer_address, "--catch-ups", str(catch_ups),
                          "--gap-s", str(gap_s), nice=nice)
            records = []
            for k in range(catch_ups):
                records.append(json_line(late))
                log(f"  catch-up {k + 1}/{catch_ups}: {records[-1]['seconds']:.3f} s")
            assert peer.stdin is not None
            peer.stdin.write("stop\n")
            peer.stdin.flush()
            steps = np.array(json_line(peer)["steps"])
        finally:
            for process in started:
                process.kill()
                process.wait(timeout=30)
            daemon.stop()

    from_coordinator = sum(r["bytes_from_coordinator"] for r in records)
    if from_coordinator:
        log(f"note: {from_coordinator:,} bytes of the catch-ups came from the coordinator")
    busy = [(r["began"], r["ended"]) for r in records]
    quiet = [(a["ended"] + SETTLE_S, b["began"]) for a, b in itertools.pairwise(records)]
    serving, between = rate(steps, busy), rate(steps, quiet)
    return {
        "name": "serving",
        "ratio": serving / between,
        "target": TARGET,
        "unit": "the peer's steps per second while serving catch-ups / between them",
        "params": params,
        "fragments": fragments,
        "step_ms": STEP_MS,
        "nice": nice,
        "steps_per_s_serving": serving,
        "steps_per_s_between": between,
        "catch_up_s": [round(r["seconds"], 3) for r in records],
        "bytes_from_peers": sum(r["bytes_from_peers"] for r in records),
        "bytes_from_coordinator": from_coordinator,
        "load_average": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--params", type=int, default=50_000_000,
                        help="parameters of the model (default 50M)")
    parser.add_argument("--fragments", type=int, default=4, help="fragments P (default 4)")
    parser.add_argument("--catch-ups", type=int, default=14,
                        help="catch-ups from the peer (default 14)")
    parser.add_argument("--gap-s", type=float, default=0.8,
                        help="quiet spell after each catch-up (default 0.8 s)")
    parser.add_argument("--nice", type=int, choices=range(20), default=19, metavar="0..19",
                        help="priority of the daemon and the catching-up learner (default "
                             "19: a core only when the peer does not want it)")
    args = parser.parse_args(argv)
    print(json.dumps(measure_serving(args.params, args.fragments, args.catch_ups,
                                     args.gap_s, args.nice)), flush=True)


if __name__ == "__main__":
    main()
