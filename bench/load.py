"""Load benchmark: many scripted learners on one daemon for minutes.

A real `python -m coordinator` process with its defaults (fsync on, quorum
1, the adaptive grace window) and `--learners` scripted learners (256 by
default), each on its own gRPC connection, split over `--drivers` driver
processes so that no single client event loop is what the latencies
measure. A learner joins, then every `--step-s` takes one "step": it pushes
one tiny fragment (fragments in turn, `--numel` fp32 parameters each,
against the newest version it knows) with its step count, and heartbeats
once per interval the daemon gives (1 s). The phases of the learners are
spread over the step, as independent learners' are. No learner ever dies.

Measured over `--seconds` (300 by default):

- false_deaths: learners the daemon ever reported as not live (Admin.Status,
  sampled every `--sample-s`), and the oldest heartbeat age it reported;
- push-ack latency: from the start of a PushFragment call to its reply, as
  the learner sees it, p50/p99/max; the same for heartbeats;
- commits per second (the fragments' versions, from Status), daemon CPU
  (user + system seconds per second, from /proc) and RSS, and the CPU of the
  driver processes (the client side, which shares the machine).

ratio = 100 ms / measured p99 push-ack latency (target >= 1: p99 within
100 ms on this machine), unit "p99 ack target / measured".

Run from the repository root: `python -m bench.load [--learners 256] [--seconds 300]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.soak import sample_process, size_flags
from bench.transfer import CHANNEL_OPTIONS, FP32, WireCount, emit, log, push_messages
from chaos.local import CoordinatorProcess as Daemon
from learner.client import Refused
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc

ACK_P99_TARGET_MS = 100.0
# Failures of transport or load, not refusals.
TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED}
LAYOUT_HASH = "bench-load"


def layout(fragments: int, numel: int) -> pb.Layout:
    return pb.Layout(hash=LAYOUT_HASH, fragments=[
        pb.FragmentSpec(fragment=p, numel=numel) for p in range(fragments)])


def learner_id(index: int) -> str:
    return f"load{index:04d}"


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# -- one scripted learner ----------------------------------------------------------------

@dataclass
class Outcome:
    """What one driver's learners saw."""

    push_ms: list[float] = field(default_factory=list)
    heartbeat_ms: list[float] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class ScriptedLearner:
    """Join, then push one tiny fragment a step and heartbeat; no model, no pulls."""

    def __init__(self, address: str, index: int, fragments: int, numel: int) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.SynchronizerStub(self.channel)
        self.learner_id = learner_id(index)
        self.offset = index % fragments
        self.fragments = fragments
        self.numel = numel
        self.versions = dict.fromkeys(range(fragments), 0)
        self.next_seq = 1
        self.step = 0
        self.heartbeat_s = 1.0

    async def join(self) -> None:
        response = await self.stub.Join(pb.JoinRequest(
            learner_id=self.learner_id, layout=layout(self.fragments, self.numel),
            host="bench", pid=os.getpid()), timeout=60)
        self.next_seq = max(self.next_seq, response.next_seq)
        self.heartbeat_s = response.heartbeat_interval_ms / 1000 or 1.0
        self._observe(response.fragments)

    def _observe(self, statuses: Any) -> None:
        for status in statuses:
            self.versions[status.fragment] = max(self.versions[status.fragment],
                                                 int(status.version))

    async def push_initial(self) -> None:
        for p in range(self.fragments):
            await self._push(p, np.zeros(self.numel, np.float32), init=True)

    async def _push(self, fragment: int, values: np.ndarray, init: bool = False,
                    base_version: int = 0) -> pb.PushResponse:
        header = pb.PushHeader(
            learner_id=self.learner_id, fragment=fragment, layout_hash=LAYOUT_HASH,
            seq=self.next_seq, base_version=base_version, c_tokens=1024, c_steps=1,
            local_step=self.step, codec=FP32.wire, numel=values.size, init=init)
        self.next_seq += 1
        response: pb.PushResponse = await self.stub.PushFragment(
            push_messages(header, values, FP32, 1 << 20, WireCount()), timeout=30)
        return response

    async def run(self, until: float, step_s: float, outcome: Outcome) -> None:
        loop = asyncio.get_running_loop()
        beating = asyncio.create_task(self._heartbeats(until, outcome))
        # Independent learners: each starts at its own point of the step.
        next_step = loop.time() + random.uniform(0, step_s)
        try:
            while True:
                await asyncio.sleep(max(next_step - loop.time(), 0))
                if time.time() >= until:
                    break
                next_step += step_s
                self.step += 1
                # Learners that started apart push different fragments at a time.
                fragment = (self.step + self.offset) % self.fragments
                delta = np.full(self.numel, 1e-4 if self.step % 2 else -1e-4, np.float32)
                started = time.perf_counter()
                try:
                    ack = await self._push(fragment, delta,
                                           base_version=self.versions[fragment])
                except grpc.aio.AioRpcError as exc:
                    if exc.code() in TRANSIENT:
                        outcome.count(outcome.errors, f"push {exc.code().name}")
                    else:  # refused: counted under the coordinator's reason
                        outcome.count(outcome.refused,
                                      Refused(exc.code(), exc.details() or "").reason)
                    continue
                outcome.push_ms.append(1e3 * (time.perf_counter() - started))
                # Acknowledged into the round for target: target - 1 is committed.
                self.versions[fragment] = max(self.versions[fragment],
                                              int(ack.target_version) - 1)
        finally:
            await beating

    async def _heartbeats(self, until: float, outcome: Outcome) -> None:
        await asyncio.sleep(random.uniform(0, self.heartbeat_s))  # its own phase too
        while time.time() < until:
            started = time.perf_counter()
            try:
                response = await self.stub.Heartbeat(pb.HeartbeatRequest(
                    learner_id=self.learner_id, local_step=self.step), timeout=5)
                outcome.heartbeat_ms.append(1e3 * (time.perf_counter() - started))
                self._observe(response.fragments)
            except grpc.aio.AioRpcError as exc:
                outcome.count(outcome.errors, f"heartbeat {exc.code().name}")
            await asyncio.sleep(max(self.heartbeat_s - (time.perf_counter() - started), 0))

    async def leave(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            await self.stub.Leave(pb.LeaveRequest(learner_id=self.learner_id, reason="done"),
                                  timeout=10)
        await self.channel.close(grace=None)


# -- a driver process ----------------------------------------------------------------------

def drive(address: str, indices: list[int], args: dict[str, Any], joined: Any,
          start_at: Any, results: Any) -> None:
    """A driver process: join its learners, wait for the common start, run them."""
    async def main() -> Outcome:
        learners = [ScriptedLearner(address, i, args["fragments"], args["numel"])
                    for i in indices]
        for learner in learners:
            await learner.join()
        joined.put(len(learners))
        begin = await asyncio.to_thread(start_at.get)
        await asyncio.sleep(max(begin - time.time(), 0))
        outcome = Outcome()
        until = begin + args["seconds"]
        await asyncio.gather(*(learner.run(until, args["step_s"], outcome)
                               for learner in learners))
        for learner in learners:
            await learner.leave()
        return outcome

    outcome = asyncio.run(main())
    results.put({"push_ms": outcome.push_ms, "heartbeat_ms": outcome.heartbeat_ms,
                 "refused": outcome.refused, "errors": outcome.errors})


# -- the monitor -----------------------------------------------------------------------------

@dataclass
class Watch:
    """What Admin.Status said over the run."""

    not_live: set[str] = field(default_factory=set)
    max_heartbeat_age_s: float = 0.0
    samples: int = 0
    status_errors: int = 0


def watch(address: str, fleet: set[str], until: float, every_s: float) -> Watch:
    seen = Watch()
    with grpc.insecure_channel(address) as channel:
        admin = pb_grpc.AdminStub(channel)
        while time.time() < until:
            started = time.monotonic()
            try:
                status = admin.Status(pb.StatusRequest(), timeout=10)
            except grpc.RpcError:
                seen.status_errors += 1
                time.sleep(every_s)
                continue
            seen.samples += 1
            for learner in status.learners:
                if learner.learner_id in fleet:
                    if not learner.live:
                        seen.not_live.add(learner.learner_id)
                    seen.max_heartbeat_age_s = max(seen.max_heartbeat_age_s,
                                                   learner.heartbeat_age_s)
            time.sleep(max(every_s - (time.monotonic() - started), 0))
    return seen


def commits(daemon: Daemon) -> int:
    return sum(max(f.version, 0) for f in daemon.status().fragments)


def initialize(address: str, fragments: int, numel: int) -> None:
    """Give every fragment its version 0 from a learner of its own, which then leaves."""
    async def init() -> None:
        learner = ScriptedLearner(address, 9999, fragments, numel)
        learner.learner_id = "load-init"
        await learner.join()
        await learner.push_initial()
        await learner.leave()

    asyncio.run(init())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=256, help="learners (default 256)")
    parser.add_argument("--seconds", type=float, default=300.0,
                        help="seconds of load (default 300)")
    size_flags(parser, fragments=16, numel=64, sample_s=0.5, sampled="Admin.Status")
    parser.add_argument("--step-s", type=float, default=1.0,
                        help="seconds per learner step, one push each (default 1)")
    parser.add_argument("--drivers", type=int, default=2,
                        help="driver processes the learners are split over (default 2)")
    parser.add_argument("--daemon-arg", action="append", default=[],
                        help="extra daemon argument, e.g. --daemon-arg=--set "
                             "--daemon-arg=fsync=false (repeatable)")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    log(f"load: {args.learners} learners over {args.drivers} drivers, {args.fragments} "
        f"fragments of {args.numel} parameters, one push per {args.step_s:g} s each, "
        f"{args.seconds:g} s; load average {load_before[0]:.2f}")
    fleet = {learner_id(i) for i in range(args.learners)}
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ftsync-bench-load-") as tmp:
        daemon = Daemon(state_dir=Path(tmp) / "state", args=args.daemon_arg).start()
        drivers: list[Any] = []
        try:
            initialize(daemon.address, args.fragments, args.numel)
            joined, start_at, results = context.Queue(), context.Queue(), context.Queue()
            settings = {"fragments": args.fragments, "numel": args.numel,
                        "seconds": args.seconds, "step_s": args.step_s}
            for d in range(args.drivers):
                indices = list(range(d, args.learners, args.drivers))
                process = context.Process(target=drive, args=(
                    daemon.address, indices, settings, joined, start_at, results))
                process.start()
                drivers.append(process)
            total = sum(joined.get(timeout=300) for _ in drivers)
            log(f"  {total} learners joined; load starts")
            begin = time.time() + 1.0
            for _ in drivers:
                start_at.put(begin)
            time.sleep(max(begin - time.time(), 0))
            pid = daemon.process.pid if daemon.process else 0
            cpu_before, commits_before = sample_process(pid), commits(daemon)
            drivers_before = sum(sample_process(d.pid).cpu_s for d in drivers)
            seen = watch(daemon.address, fleet, begin + args.seconds, args.sample_s)
            cpu_after, commits_after = sample_process(pid), commits(daemon)
            drivers_after = sum(sample_process(d.pid).cpu_s for d in drivers)
            window = time.time() - begin
            outcomes = [results.get(timeout=120) for _ in drivers]
            for process in drivers:
                process.join(timeout=60)
        finally:
            for process in drivers:
                if process.is_alive():
                    process.kill()
            daemon.stop()
    push_ms = [x for o in outcomes for x in o["push_ms"]]
    heartbeat_ms = [x for o in outcomes for x in o["heartbeat_ms"]]
    refused: dict[str, int] = {}
    errors: dict[str, int] = {}
    for o in outcomes:
        for table, part in ((refused, o["refused"]), (errors, o["errors"])):
            for key, n in part.items():
                table[key] = table.get(key, 0) + n
    p99 = percentile(push_ms, 99)
    result = {
        "name": "load",
        "ratio": ACK_P99_TARGET_MS / p99,
        "target": 1.0,
        "unit": f"p99 push-ack target ({ACK_P99_TARGET_MS:g} ms) / measured p99",
        "false_deaths": len(seen.not_live),
        "false_deaths_target": 0,
        "ack_p99_ms": p99,
        "ack_p99_target_ms": ACK_P99_TARGET_MS,
        "ack_p50_ms": percentile(push_ms, 50),
        "ack_max_ms": max(push_ms, default=float("nan")),
        "heartbeat_p50_ms": percentile(heartbeat_ms, 50),
        "heartbeat_p99_ms": percentile(heartbeat_ms, 99),
        "heartbeat_max_ms": max(heartbeat_ms, default=float("nan")),
        "max_heartbeat_age_s": seen.max_heartbeat_age_s,
        "commits_per_s": (commits_after - commits_before) / window,
        "pushes_per_s": len(push_ms) / window,
        "daemon_cpu": (cpu_after.cpu_s - cpu_before.cpu_s) / window,
        # The learners' side, all drivers together: near their share of the machine,
        # their own event loops add to the latencies measured.
        "drivers_cpu": (drivers_after - drivers_before) / window,
        "daemon_rss_mb": cpu_after.rss_bytes / 1e6,
        "daemon_fds": cpu_after.fds,
        "learners": args.learners,
        "drivers": args.drivers,
        "fragments": args.fragments,
        "numel": args.numel,
        "step_s": args.step_s,
        "seconds": window,
        "pushes": len(push_ms),
        "refused": refused,
        "errors": errors,
        "not_live": sorted(seen.not_live),
        "status_samples": seen.samples,
        "daemon_args": args.daemon_arg,
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    log(f"  false deaths {result['false_deaths']}, push ack p50/p99 "
        f"{result['ack_p50_ms']:.1f}/{p99:.1f} ms, {result['commits_per_s']:.1f} commits/s, "
        f"daemon CPU {result['daemon_cpu']:.2f} cores, drivers {result['drivers_cpu']:.2f}")
    emit(result)


if __name__ == "__main__":
    main()
