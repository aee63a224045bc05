"""Goodput benchmark: the quickstart chaos experiment, async against lock-step.

Runs `experiments/quickstart.toml` (async ftsync: quorum 1, grace window,
staleness weighting) and `experiments/quickstart-sync.toml` (the same
learners, fault schedule and seed against lock-step DiLoCo: quorum = every
learner, no grace window, learners wait for each merge) one after the other
through the real harness, and computes each run's goodput and uptime from
its merged event log exactly as the chaos report does.

Goodput = learner time whose work reached the global model / learner time
allocated (see `chaos/metrics.py`). Targets: async goodput >= 0.90 and
async/sync >= 1.5.

Run from the repository root: `python -m bench.goodput [--out DIR]`. Progress
goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from chaos.experiment import load_experiment
from chaos.history import load_log
from chaos.metrics import goodput, uptime
from chaos.runner import run_cluster

ROOT = Path(__file__).resolve().parents[1]
GOODPUT_TARGET = 0.90
RATIO_TARGET = 1.5


def measure(experiment_file: Path, out: Path) -> dict[str, float]:
    experiment = load_experiment(experiment_file)
    if out.exists():
        shutil.rmtree(out)
    started = time.monotonic()
    run_cluster(experiment, out)
    wall = time.monotonic() - started
    events = load_log(sorted(out.glob("*.events.jsonl"))).events
    g = goodput(events)
    u = uptime(events, experiment.checks.window_s)
    print(f"  {experiment.name}: goodput {g.value:.3f} ({g.useful_s:.0f} s useful of "
          f"{g.allocated_s:.0f} s allocated), uptime {u.value:.3f}, wall {wall:.0f} s",
          file=sys.stderr, flush=True)
    return {"goodput": g.value, "uptime": u.value, "useful_s": g.useful_s,
            "allocated_s": g.allocated_s, "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-goodput"))
    args = parser.parse_args(argv)
    print("quickstart (async) and quickstart-sync (lock-step), same faults and seed",
          file=sys.stderr, flush=True)
    a = measure(ROOT / "experiments" / "quickstart.toml", args.out / "async")
    s = measure(ROOT / "experiments" / "quickstart-sync.toml", args.out / "sync")
    ratio = a["goodput"] / s["goodput"] if s["goodput"] > 0 else float("inf")
    print(json.dumps({
        "name": "goodput", "ratio": ratio, "target": RATIO_TARGET,
        "unit": "goodput async / goodput sync",
        "goodput_async": a["goodput"], "goodput_sync": s["goodput"],
        "goodput_async_target": GOODPUT_TARGET,
        "uptime_async": a["uptime"], "uptime_sync": s["uptime"],
        "async": a, "sync": s,
    }), flush=True)


if __name__ == "__main__":
    main()
