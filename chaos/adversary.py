"""An adversarial learner: joins a run and sends what a broken or hostile
learner would — NaN values, wrong shapes, huge norms, replayed contribution
ids — for the chaos harness's `adversary` fault.

It speaks the wire protocol directly (not through the honest client), logs
each attempt and the coordinator's answer as events, and counts how many
were accepted: for NaN, shape and norm that must be none, for a replay only
the first of the two identical pushes.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np

from learner.fragments import plan_fragments
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos import tls
from protos.codec import FP32, iter_chunk_messages
from protos.events import EventLog

KINDS = ("nan", "shape", "norm", "replay")


def layout_of(task: str, size: str, fragments: int, dim: int) -> tuple[str, list[int]]:
    """The run's layout hash and fragment sizes, as honest learners compute them."""
    if task == "synthetic":
        from learner.synthetic import RegressionTask, layout_hash

        bounds = RegressionTask(dim=dim).fragment_bounds(fragments)
        numels = [b - a for a, b in bounds]
        return layout_hash(numels, f"synthetic-{dim}"), numels
    from learner.tasks import task_named

    plan = plan_fragments(task_named(task, size=size).build_model(), fragments)
    return plan.hash, plan.numels


class Adversary:
    def __init__(self, address: str, learner_id: str, layout: tuple[str, list[int]],
                 events: EventLog, credentials: tls.TlsMaterial | None = None) -> None:
        self.address = address
        self.credentials = credentials
        self.learner_id = learner_id
        self.layout_hash, self.numels = layout
        self.events = events
        self.seq = 1
        self.accepted: dict[str, int] = {}
        self.rejected: dict[str, int] = {}

    async def run(self, kinds: list[str], every_s: float, duration_s: float) -> None:
        async with tls.aio_channel(self.address, self.credentials) as channel:
            stub = pb_grpc.SynchronizerStub(channel)
            versions = await self._join(stub)
            deadline = time.monotonic() + duration_s
            attempt = 0
            # Each kind at least once, however slowly the attacks go: a run judges them.
            while time.monotonic() < deadline or attempt < len(kinds):
                kind = kinds[attempt % len(kinds)]
                fragment = attempt % len(self.numels)
                # Attack against the current version, so only the attack itself is wrong.
                await self._attack(stub, kind, fragment, max(versions.get(fragment, 0), 0))
                try:
                    beat = await stub.Heartbeat(
                        pb.HeartbeatRequest(learner_id=self.learner_id), timeout=5)
                    versions = {f.fragment: f.version for f in beat.fragments}
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        versions = await self._join(stub)  # the coordinator restarted
                attempt += 1
                await asyncio.sleep(every_s)
            await stub.Leave(pb.LeaveRequest(learner_id=self.learner_id, reason="done"),
                             timeout=5)

    async def _join(self, stub: pb_grpc.SynchronizerStub) -> dict[int, int]:
        joined = await stub.Join(pb.JoinRequest(
            learner_id=self.learner_id, layout=pb.Layout(
                hash=self.layout_hash,
                fragments=[pb.FragmentSpec(fragment=i, numel=n)
                           for i, n in enumerate(self.numels)])), timeout=30,
            wait_for_ready=True)
        self.seq = max(self.seq, joined.next_seq)
        return {f.fragment: f.version for f in joined.fragments}

    async def _attack(self, stub: pb_grpc.SynchronizerStub, kind: str, fragment: int,
                      version: int) -> None:
        numel = self.numels[fragment]
        delta = np.full(numel, 1e-3, dtype=np.float32)
        declared = numel
        if kind == "nan":
            delta[numel // 2] = np.nan
        elif kind == "shape":
            delta = np.full(numel + 7, 1e-3, dtype=np.float32)
        elif kind == "norm":
            delta[:] = 1e6
        seq = self.seq
        self.seq += 1
        await self._push(stub, kind, fragment, seq, version, delta, declared)
        if kind == "replay":
            await self._push(stub, "replay-again", fragment, seq, version, delta, declared)

    async def _push(self, stub: pb_grpc.SynchronizerStub, kind: str, fragment: int, seq: int,
                    version: int, delta: np.ndarray, declared: int) -> None:
        header = pb.PushHeader(learner_id=self.learner_id, fragment=fragment,
                               layout_hash=self.layout_hash, seq=seq, base_version=version,
                               c_tokens=1, c_steps=1, codec=FP32.wire, numel=declared)

        async def messages() -> AsyncIterator[pb.PushMessage]:
            yield pb.PushMessage(header=header)
            for message in iter_chunk_messages(delta, FP32, pb.PushMessage):
                yield message

        try:
            await stub.PushFragment(messages(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            self.rejected[kind] = self.rejected.get(kind, 0) + 1
            self.events.emit("adversary", learner=self.learner_id, attack=kind,
                             fragment=fragment, seq=seq, accepted=False,
                             code=exc.code().name, message=(exc.details() or "")[:200])
            return
        self.accepted[kind] = self.accepted.get(kind, 0) + 1
        self.events.emit("adversary", learner=self.learner_id, attack=kind, fragment=fragment,
                         seq=seq, accepted=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m chaos.adversary",
                                     description="Send corrupt contributions to a run.")
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--learner-id", default="adversary")
    parser.add_argument("--task", default="lm-stdlib")
    parser.add_argument("--size", default="small")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024, help="synthetic task size")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--every", type=float, default=0.5, help="seconds between attacks")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--event-log", default="")
    tls.add_flags(parser, "issued to --learner-id")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds takes a comma-separated subset of {','.join(KINDS)}")
    events = EventLog(args.event_log, source=args.learner_id)
    adversary = Adversary(args.coordinator, args.learner_id,
                          layout_of(args.task, args.size, args.fragments, args.dim), events,
                          tls.load(tls.from_flags(args)))
    asyncio.run(adversary.run(kinds, args.every, args.duration))
    print(f"{args.learner_id}: accepted {adversary.accepted}, rejected {adversary.rejected}",
          flush=True)
    events.close()


if __name__ == "__main__":
    main()
