"""Cold-start benchmark: a fresh `ftsync-learner` process from spawn to its join and
to its first training step, against the same learner importing `torch._dynamo`
before anything else, as it did before `learner.tasks.import_dynamo_aside`.

Each run spawns `python -m learner --task lm-stdlib` against a real daemon (fsync
off) and reads two times from its event log: the `join` event (the coordinator
took it) and the first `train` event (its first step is done), both counted from
the spawn. The baseline is the same command run as `python -c "import
torch._dynamo; ..."`: every import the learner makes, in sequence, as when the
first optimizer call imported dynamo before the join. Runs alternate between the
two, so a change in the machine's load reaches both; the medians count.

Run from the repository root: `python -m bench.coldstart [--runs N]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos.local import CoordinatorProcess as Daemon

EAGER = ("import sys, torch._dynamo; from learner.cli import main; "
         "sys.argv[0] = 'ftsync-learner'; main()")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def one_start(address: str, events: Path, learner_id: str, eager: bool) -> dict[str, float]:
    """Spawn one learner; seconds from the spawn to its join and to its first step."""
    args = ["--coordinator", address, "--learner-id", learner_id, "--task", "lm-stdlib",
            "--size", "small", "--steps", "2", "--progress-every", "1",
            "--event-log", str(events)]
    command = ([sys.executable, "-c", EAGER, *args] if eager
               else [sys.executable, "-m", "learner", *args])
    spawned = time.time()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"learner exited {done.returncode}: {done.stderr[-2000:]}")
    records = [json.loads(line) for line in events.read_text().splitlines()]
    joined = next(r["t"] for r in records if r["kind"] == "join")
    stepped = next(r["t"] for r in records if r["kind"] == "train")
    return {"join_s": joined - spawned, "first_step_s": stepped - spawned}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--runs", type=int, default=5, help="starts of each kind (default 5)")
    args = parser.parse_args(argv)
    results: dict[str, list[dict[str, float]]] = {"aside": [], "eager": []}
    with tempfile.TemporaryDirectory(prefix="ftsync-bench-coldstart-") as tmp:
        daemon = Daemon(state_dir=Path(tmp) / "state", args=["--set", "fsync=false"]).start()
        try:
            for run in range(args.runs):
                for kind in ("aside", "eager"):
                    events = Path(tmp) / f"{kind}-{run}.events.jsonl"
                    result = one_start(daemon.address, events, f"{kind}-{run}", kind == "eager")
                    results[kind].append(result)
                    log(f"{kind:>5} run {run}: join {result['join_s']:.2f} s, first step "
                        f"{result['first_step_s']:.2f} s")
        finally:
            daemon.stop()

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    summary: dict[str, Any] = {
        "name": "coldstart",
        # Spawn to join: what a restarted learner waits before it counts again.
        "ratio": median("eager", "join_s") / median("aside", "join_s"),
        "target": 1.0,
        "unit": "spawn-to-join speedup (eager dynamo import over aside)",
        "join_s": median("aside", "join_s"),
        "join_eager_s": median("eager", "join_s"),
        "first_step_s": median("aside", "first_step_s"),
        "first_step_eager_s": median("eager", "first_step_s"),
        "first_step_speedup": median("eager", "first_step_s") / median("aside", "first_step_s"),
        "runs": results,
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
