"""A learner written from docs/protocol.md alone: numpy, grpcio and the stubs generated
from protos/ftsync.proto, nothing of ftsync's own learner or coordinator.

It trains the synthetic regression of `ftsync-learner --task synthetic` (the same
layout, so it joins a run beside those learners), and every `--sync-every` steps
pushes each fragment's outer gradient, heartbeats, pulls the merged version and
applies it. Run it as `python learner/examples/minimal_learner.py --coordinator
HOST:PORT`; its last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's protos/
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc

CHUNK_ELEMENTS = (2 << 20) // 4  # 2 MiB of fp32 per chunk
T = TypeVar("T")


def layout(dim: int, fragments: int) -> tuple[list[tuple[int, int]], str]:
    """The synthetic task's fragments and layout hash, as the guide defines them."""
    edges = [p * dim // fragments for p in range(fragments + 1)]
    bounds = list(itertools.pairwise(edges))
    listed = ", ".join(str(b - a) for a, b in bounds)
    return bounds, hashlib.sha256(f"synthetic-{dim}:[{listed}]".encode()).hexdigest()[:16]


def reason(error: grpc.RpcError) -> str:
    """The refusal's reason code, from the `ftsync-reason` trailing metadata."""
    trailing: Any = error.trailing_metadata() or ()
    return next((value for key, value in trailing if key == "ftsync-reason"), "")


class MinimalLearner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.id = args.learner_id
        self.bounds, self.hash = layout(args.dim, args.fragments)
        self.auth = (("authorization", f"Bearer {args.token}"),) if args.token else ()
        self.stub = pb_grpc.SynchronizerStub(grpc.insecure_channel(args.coordinator))
        rng = np.random.default_rng(args.seed)
        self.true_w = (rng.normal(size=args.dim) / np.sqrt(args.dim)).astype(np.float32)
        self.data = np.random.default_rng([args.seed, args.shard, 7])
        self.params = np.zeros(args.dim, np.float32)
        self.ref: list[np.ndarray] = []  # θ_ref per fragment
        self.base: list[int] = []  # base_version per fragment
        self.outbox: dict[tuple[int, int], pb.PushHeader] = {}  # not yet merged
        self.deltas: dict[tuple[int, int], np.ndarray] = {}
        self.next_seq = 1
        self.pushed = self.merged = 0
        self.refused: dict[str, int] = {}
        self.applied: list[tuple[int, int]] = []  # (fragment, version)
        self.rejoining = False

    def retrying(self, attempt: Callable[[], T], attempts: int = 8) -> T:
        """One whole call, again while the coordinator is unreachable (it restarts, or
        a new leader takes over) and after joining again when it forgot us: every call
        may be refused `unknown_learner` once a coordinator restarted."""
        for n in range(attempts):
            try:
                return attempt()
            except grpc.RpcError as error:
                if n + 1 == attempts:
                    raise
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    time.sleep(0.2 * 2 ** n)
                elif reason(error) == "unknown_learner" and not self.rejoining:
                    self.rejoin()
                else:
                    raise
        raise AssertionError("unreachable")

    def call(self, method: str, request: object) -> Any:
        return self.retrying(
            lambda: getattr(self.stub, method)(request, metadata=self.auth, timeout=30))

    # -- joining --------------------------------------------------------------

    def join(self) -> pb.JoinResponse:
        specs = [pb.FragmentSpec(fragment=p, numel=b - a)
                 for p, (a, b) in enumerate(self.bounds)]
        response: pb.JoinResponse = self.call("Join", pb.JoinRequest(
            learner_id=self.id, layout=pb.Layout(hash=self.hash, fragments=specs),
            overlap_steps=1, host="minimal"))
        self.next_seq = max(self.next_seq, response.next_seq)
        return response

    def rejoin(self) -> None:
        """Join again, then push again whatever was acknowledged but not merged: a
        restarted coordinator may have lost the open rounds that held it."""
        self.rejoining = True
        try:
            self.join()
            for key in sorted(self.outbox):
                self.send(*key)
        finally:
            self.rejoining = False

    def start(self) -> None:
        for status in self.join().fragments:
            if status.version < 0:  # offer our values; ALREADY_EXISTS: another won
                a, b = self.bounds[status.fragment]
                header = self.header(status.fragment, b - a, base=0, tokens=0, steps=0)
                header.init = True
                try:
                    self.push(header, self.params[a:b])
                except grpc.RpcError as error:
                    if error.code() != grpc.StatusCode.ALREADY_EXISTS:
                        raise
        while True:  # every fragment at one consistent vector of versions
            fragments = self.retrying(lambda: self.read(self.stub.FetchSnapshot(
                pb.SnapshotRequest(learner_id=self.id), metadata=self.auth, timeout=30)))
            if all(version >= 0 for version, _ in fragments.values()):
                break
            time.sleep(0.1)  # another learner is still pushing its initial value
        for p, (version, values) in sorted(fragments.items()):
            a, b = self.bounds[p]
            self.params[a:b] = values
            self.ref.append(values.copy())
            self.base.append(version)

    def read(self, stream: Iterator[pb.PullMessage]) -> dict[int, tuple[int, np.ndarray]]:
        """Headers and their fp32 chunks (in order, from offset 0) into vectors."""
        out: dict[int, tuple[int, np.ndarray]] = {}
        for message in stream:
            if message.WhichOneof("kind") == "header":
                head = message.header
                if head.not_modified:
                    continue
                values = np.empty(head.numel, np.float32)
                out[head.fragment] = (head.version, values)
                self.note_merged(head.fragment, head.merged_seq)
            else:
                chunk = message.chunk
                values[chunk.offset:chunk.offset + chunk.count] = np.frombuffer(chunk.data, "<f4")
        return out

    # -- pushing ----------------------------------------------------------------

    def header(self, p: int, numel: int, base: int, tokens: int, steps: int) -> pb.PushHeader:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return pb.PushHeader(learner_id=self.id, fragment=p, layout_hash=self.hash, seq=seq,
                             base_version=base, c_tokens=tokens, c_steps=steps,
                             codec=pb.CODEC_FP32, numel=numel)

    def push(self, header: pb.PushHeader, values: np.ndarray) -> pb.PushResponse:
        def messages() -> Iterator[pb.PushMessage]:
            yield pb.PushMessage(header=header)
            for offset in range(0, values.size, CHUNK_ELEMENTS):
                part = values[offset:offset + CHUNK_ELEMENTS]
                yield pb.PushMessage(chunk=pb.Chunk(offset=offset, count=part.size,
                                                    data=part.astype("<f4").tobytes()))
        response: pb.PushResponse = self.stub.PushFragment(messages(), metadata=self.auth,
                                                           timeout=60)
        return response

    def contribute(self, p: int, tokens: int, steps: int) -> None:
        """Push Δ = θ_ref − θ_now against the base; θ_ref becomes θ_now."""
        a, b = self.bounds[p]
        delta = self.ref[p] - self.params[a:b]
        header = self.header(p, b - a, self.base[p], tokens, steps)
        self.ref[p] = self.params[a:b].copy()
        self.outbox[(p, header.seq)], self.deltas[(p, header.seq)] = header, delta
        self.send(p, header.seq)

    def send(self, p: int, seq: int) -> None:
        if (p, seq) not in self.outbox:  # merged meanwhile
            return
        try:
            self.retrying(lambda: self.push(self.outbox[(p, seq)], self.deltas[(p, seq)]))
            self.pushed += 1
        except grpc.RpcError as error:
            why = reason(error)
            if why == "replayed":  # held by the open round, or merged already
                return
            self.refused[why] = self.refused.get(why, 0) + 1
            self.forget(p, seq)  # stale, future_version, ...: dropped for that reason

    def note_merged(self, p: int, merged_seq: int) -> None:
        for key in [k for k in self.outbox if k[0] == p and k[1] <= merged_seq]:
            self.merged += 1
            self.forget(*key)

    def forget(self, p: int, seq: int) -> None:
        self.outbox.pop((p, seq), None)
        self.deltas.pop((p, seq), None)

    # -- pulling and applying -----------------------------------------------------

    def sync(self, step: int) -> None:
        for p in range(len(self.bounds)):
            # A beat before each long poll: the polls together may outlast the
            # coordinator's heartbeat timeout.
            beat = self.call("Heartbeat", pb.HeartbeatRequest(
                learner_id=self.id, local_step=step, backlog=len(self.outbox)))
            for status in beat.fragments:
                self.note_merged(status.fragment, status.merged_seq)
            for version, values in self.pull(p).values():
                a, b = self.bounds[p]
                self.params[a:b] = values  # apply: overwrite (α = 0)
                self.ref[p], self.base[p] = values.copy(), version
                self.applied.append((p, version))

    def pull(self, p: int) -> dict[int, tuple[int, np.ndarray]]:
        """A version of fragment `p` newer than our base, if one comes within the wait."""
        request = pb.PullRequest(learner_id=self.id, fragment=p, have_version=self.base[p],
                                 wait_ms=self.args.pull_wait_ms)
        return self.retrying(lambda: self.read(
            self.stub.PullFragment(request, metadata=self.auth, timeout=60)))

    # -- training ---------------------------------------------------------------------

    def train_step(self, batch: int = 32, lr: float = 0.01) -> None:
        x = self.data.normal(size=(batch, self.args.dim)).astype(np.float32)
        y = x @ self.true_w
        self.params -= lr * (2.0 / batch) * (x.T @ (x @ self.params - y))

    def eval_loss(self) -> float:
        x = np.random.default_rng([self.args.seed, 99]).normal(size=(256, self.args.dim))
        return float(np.mean((x @ self.params - x @ self.true_w) ** 2))

    def run(self) -> dict[str, object]:
        self.start()
        start_loss = self.eval_loss()
        for step in range(1, self.args.steps + 1):
            self.train_step()
            if step % self.args.sync_every == 0:
                for p in range(len(self.bounds)):
                    self.contribute(p, tokens=32 * self.args.sync_every,
                                    steps=self.args.sync_every)
                self.sync(step)
        self.call("Leave", pb.LeaveRequest(learner_id=self.id, reason="done"))
        return {"learner": self.id, "pushed": self.pushed, "merged": self.merged,
                "refused": self.refused, "applied": self.applied, "unsettled": len(self.outbox),
                "eval_loss_start": start_loss, "eval_loss_end": self.eval_loss()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--coordinator", default="127.0.0.1:50051")
    parser.add_argument("--learner-id", default="minimal")
    parser.add_argument("--token", default="")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pull-wait-ms", type=int, default=2000)
    print(json.dumps(MinimalLearner(parser.parse_args()).run()), flush=True)


if __name__ == "__main__":
    main()
