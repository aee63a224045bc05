"""Goodput benchmark: the quickstart chaos experiment, async against lock-step.

Runs `experiments/quickstart.toml` (async ftsync: quorum 1, grace window,
staleness weighting, one warm spare that takes each killed learner's slot),
the same without its spare, and `experiments/quickstart-sync.toml` (the same
learners, fault schedule and seed against lock-step DiLoCo: quorum = every
learner, no grace window, learners wait for each merge, killed learners
restarted cold) one after the other through the real harness, and computes
each run's goodput, its bound and uptime from its merged event log exactly as
the chaos report does.

Goodput = learner time whose work reached the global model / learner time
allocated (see `chaos/metrics.py`); a spare's time before it takes a slot is
not allocated to the run (it stands by, as a standby pod would). `goodput_bound`
is the async run's bound, 1 − its down time / allocated (with a spare, a kill is
down only until the spare takes the slot); `goodput_bound_no_spares` is the
spare-less run's, down for the whole scripted 4 s of each kill.
Targets: async goodput (with the spare) >= 0.92 and async/sync >= 1.5.

With `--backend docker` it runs instead `experiments/quickstart.toml` on local
processes and `experiments/docker-quickstart.toml` (the same schedule and seed,
every process a container; the image must be built, deploy/docker/build) and
reports docker goodput / process goodput (target >= 0.90), and beside it each
restarted learner's restart -> rejoin time (the harness's restart to the
learner's next `join`) on both backends.

Run from the repository root: `python -m bench.goodput [--backend docker]
[--out DIR]`. Progress goes to stderr; the last line of stdout is one JSON
object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from chaos.experiment import DockerSpec, load_experiment
from chaos.history import Event, load_log
from chaos.metrics import goodput, uptime
from chaos.runner import run_cluster

ROOT = Path(__file__).resolve().parents[1]
GOODPUT_TARGET = 0.92
RATIO_TARGET = 1.5
DOCKER_RATIO_TARGET = 0.90


def rejoin_times(events: list[Event]) -> list[float]:
    """Per learner restart (a kill_learner's heal), seconds to its next `join`."""
    times = []
    for restart in events:
        if not (restart.source == "harness" and restart.kind == "fault"
                and restart.get("fault") == "kill_learner" and restart.get("action") == "heal"):
            continue
        join = next((e for e in events if e.kind == "join" and e.t > restart.t
                     and e.source == restart.get("target")), None)
        if join is not None:
            times.append(round(join.t - restart.t, 2))
    return times


def measure(experiment_file: Path, out: Path, image: str = "",
            spares: int | None = None) -> dict[str, Any]:
    """One run of the experiment (`spares`: instead of the file's learners.spares)."""
    experiment = load_experiment(experiment_file)
    if image:
        experiment = dataclasses.replace(experiment, docker=DockerSpec(image))
    if spares is not None:
        experiment = dataclasses.replace(
            experiment, learners=dataclasses.replace(experiment.learners, spares=spares))
    if out.exists():
        shutil.rmtree(out)
    started = time.monotonic()
    run_cluster(experiment, out)
    wall = time.monotonic() - started
    events = load_log(sorted(out.glob("*.events.jsonl"))).events
    g = goodput(events)
    u = uptime(events, experiment.checks.window_s)
    rejoin = rejoin_times(events)
    print(f"  {experiment.name} (spares {experiment.learners.spares}): goodput {g.value:.3f} "
          f"({g.useful_s:.0f} s useful of {g.allocated_s:.0f} s allocated, bound "
          f"{g.bound:.3f}), uptime {u.value:.3f}, wall {wall:.0f} s, restart -> rejoin "
          f"{rejoin} s", file=sys.stderr, flush=True)
    return {"goodput": g.value, "bound": g.bound, "losses": g.losses, "uptime": u.value,
            "useful_s": g.useful_s, "allocated_s": g.allocated_s, "wall_s": wall,
            "rejoin_s": rejoin, "spares": experiment.learners.spares}


def compare_backends(out: Path, image: str) -> None:
    print("quickstart on processes and docker-quickstart in containers, same faults and seed",
          file=sys.stderr, flush=True)
    p = measure(ROOT / "experiments" / "quickstart.toml", out / "process")
    d = measure(ROOT / "experiments" / "docker-quickstart.toml", out / "docker", image)
    print(json.dumps({
        "name": "goodput-docker", "ratio": d["goodput"] / p["goodput"] if p["goodput"] else 0.0,
        "target": DOCKER_RATIO_TARGET, "unit": "goodput docker / goodput process",
        "goodput_docker": d["goodput"], "goodput_process": p["goodput"],
        "rejoin_s_docker": d["rejoin_s"], "rejoin_s_process": p["rejoin_s"],
        "docker": d, "process": p,
    }), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-goodput"))
    parser.add_argument("--backend", choices=("process", "docker"), default="process",
                        help="docker: the quickstart in containers against on processes")
    parser.add_argument("--image", default="", help="with --backend docker: the image "
                        "(default: the experiment's, ftsync:latest)")
    args = parser.parse_args(argv)
    if args.backend == "docker":
        compare_backends(args.out, args.image)
        return
    print("quickstart (async, with and without its spare) and quickstart-sync (lock-step), "
          "same faults and seed", file=sys.stderr, flush=True)
    quickstart = ROOT / "experiments" / "quickstart.toml"
    a = measure(quickstart, args.out / "async")
    bare = measure(quickstart, args.out / "async-no-spares", spares=0)
    s = measure(ROOT / "experiments" / "quickstart-sync.toml", args.out / "sync")
    ratio = a["goodput"] / s["goodput"] if s["goodput"] > 0 else float("inf")
    print(json.dumps({
        "name": "goodput", "ratio": ratio, "target": RATIO_TARGET,
        "unit": "goodput async / goodput sync",
        "goodput_async": a["goodput"], "goodput_sync": s["goodput"],
        "goodput_async_target": GOODPUT_TARGET,
        "goodput_async_no_spares": bare["goodput"], "goodput_bound": a["bound"],
        "goodput_bound_no_spares": bare["bound"],
        "uptime_async": a["uptime"], "uptime_sync": s["uptime"],
        "async": a, "async_no_spares": bare, "sync": s,
    }), flush=True)


if __name__ == "__main__":
    main()
