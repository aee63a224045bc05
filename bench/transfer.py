"""Transfer benchmark: fp32 fragments pushed to and pulled from the real daemon, over
loopback, against a plain TCP socket moving the same bytes, both measured in one run.

The daemon is a real `python -m coordinator` process (started with `fsync=false`: this
measures the network path, not the disk). One learner joins, pushes every fragment's
initial value and pulls it back (the warm-up, untimed), then times rounds of one outer
gradient per fragment pushed and the merged version pulled back: sequential rounds (the
fragments one after another, one stream at a time) alternate with concurrent ones (one
push-then-pull task per fragment, all at once). The best round of each mode counts and the
better mode is the headline. The merge and outer step run inside the timed window, as they
would for a learner; how long the pulls waited for the new version is reported beside it.

The baseline is a socket server in its own process that receives the same number of
bytes into one buffer with `recv_into` and sends them back with `sendall`: what a
learner-to-coordinator round trip costs with no RPC, no codec and no merge. It runs before
and after the daemon, and the best run counts.

It then pushes the same outer gradient with each codec and reports the bytes on the wire
and the parameters per second each achieves, client-side encoding included. As a third
reference, a bare grpcio asyncio server in its own process echoes the same bytes as raw
`bytes` messages of the same chunk size (no protobuf, no numpy, no daemon): the ceiling any
Python gRPC service reaches here, which separates the library's cost from the daemon's.

With `--tls` the timed rounds run again against a daemon that requires client
certificates (`tls_ratio`: TLS against plaintext), and the raw socket server runs over TLS
with the bulk port's own contexts (`protos.tls`): `tls_socket_ratio`, the same raw round
trip over TLS against plaintext, is what the encryption alone costs these bytes here, and
`tls_vs_tls_socket` what the daemon makes of the TLS socket (as `ratio` says what it makes
of the plaintext one).

Run from the repository root: `python -m bench.transfer [--params N] [--fragments P]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from numpy.typing import NDArray

from chaos.local import CoordinatorProcess as Daemon
from coordinator.certs import make_certificates
from coordinator.config import OuterConfig
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos import metadata, tls
from protos.bulk import BulkPool
from protos.codec import (
    DEFAULT_CHUNK_BYTES,
    MESSAGE_SIZE_OPTIONS,
    Codec,
    chunk_elements,
    codec_named,
    decode_chunk_into,
)
from protos.stream import ChunkReader

MIB = 1 << 20
MB = 1e6
CHANNEL_OPTIONS = [
    *MESSAGE_SIZE_OPTIONS,
    # Each learner gets its own TCP connection, as separate processes would.
    ("grpc.use_local_subchannel_pool", 1),
]
LAYOUT_HASH = "bench-layout"
FP32 = codec_named("fp32")
CODEC_NAMES = ("fp32", "bf16", "int8", "e3m0")
PULL_WAIT_MS = 120_000
# The outer optimizer of the daemon this benchmark starts (at the config's defaults; one
# learner at staleness 0 steps unscaled), for the check that the first merged version is
# what it makes of one contribution: read from the config, not copied (a copy went stale).
OUTER = OuterConfig()

Floats = NDArray[np.float32]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def emit(result: dict[str, Any]) -> None:
    """The benchmark's one line of stdout."""
    print(json.dumps(result, sort_keys=False), flush=True)


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", type=int, default=100_000_000,
                        help="fp32 parameters in the model (default 100M)")
    parser.add_argument("--fragments", type=int, default=4, help="fragments P (default 4)")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                        help="bytes per pushed chunk (default 2 MiB)")
    return parser


@contextmanager
def daemon_environment(pairs: Sequence[str]) -> Iterator[None]:
    """`KEY=VALUE` pairs set in os.environ while a daemon starts (it inherits them)."""
    saved = dict(os.environ)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--daemon-env expects KEY=VALUE, got {pair!r}")
        os.environ[key] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def fragment_sizes(params: int, fragments: int) -> list[int]:
    if fragments < 1 or params < fragments:
        raise SystemExit(f"need at least one parameter per fragment (got {params} params, "
                         f"{fragments} fragments)")
    base, extra = divmod(params, fragments)
    return [base + (1 if p < extra else 0) for p in range(fragments)]


def make_layout(sizes: Sequence[int]) -> pb.Layout:
    return pb.Layout(hash=LAYOUT_HASH, fragments=[
        pb.FragmentSpec(fragment=p, numel=n) for p, n in enumerate(sizes)])


def split(values: Floats, sizes: Sequence[int]) -> list[Floats]:
    """Contiguous views of `values`, one per fragment."""
    offsets = np.cumsum(sizes)[:-1]
    return list(np.split(values, offsets))


def make_model(params: int, seed: int = 0) -> tuple[Floats, Floats]:
    """Parameters θ ~ N(0, 1) and an outer gradient Δ = 1e-3·θ (norm well inside the bound)."""
    rng = np.random.default_rng(seed)
    theta = rng.standard_normal(params, dtype=np.float32)
    delta = theta * np.float32(1e-3)
    return theta, delta


@dataclass
class WireCount:
    """Chunk payload bytes a push stream carried (what the daemon counts as bytes_in)."""

    data_bytes: int = 0


@dataclass(frozen=True)
class Pulled:
    version: int
    data_bytes: int
    wait_s: float  # from the request to the header: waiting for the version to be published
    stream_s: float  # from the header to the last chunk decoded


def push_messages(header: pb.PushHeader, values: Floats, codec: Codec, chunk_bytes: int,
                  count: WireCount) -> Iterator[pb.PushMessage]:
    """The push stream, encoded lazily: one chunk in memory at a time.

    Chunks are cut and encoded exactly as `iter_chunks` does, but written straight into
    the `PushMessage`: wrapping a finished `Chunk` (`PushMessage(chunk=chunk)`) costs upb a
    serialise and a parse of the 2 MiB payload, and reading `chunk.data` back for its length
    another copy, which would make this client, not the daemon, the bottleneck.
    """
    yield pb.PushMessage(header=header)
    step = chunk_elements(codec, chunk_bytes)
    for offset in range(0, values.size, step):
        part = values[offset:offset + step]
        data, scale = codec.encode(part)
        message = pb.PushMessage()
        chunk = message.chunk
        chunk.offset = offset
        chunk.count = part.size
        chunk.scale = scale
        chunk.data = data
        count.data_bytes += len(data)
        yield message


class BenchLearner:
    """The least a learner does: join, push, pull, heartbeat over gRPC, the bytes of
    pushes and pulls on the bulk channel (`bulk`, as a learner does by default) or as
    chunks on the calls."""

    def __init__(self, address: str, learner_id: str, sizes: Sequence[int],
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 credentials: tls.TlsMaterial | None = None, bulk: bool = True) -> None:
        self.channel = tls.aio_channel(address, credentials, CHANNEL_OPTIONS)
        self.stub = pb_grpc.SynchronizerStub(self.channel)
        self.learner_id = learner_id
        self.sizes = list(sizes)
        self.chunk_bytes = chunk_bytes
        self.next_seq = 1
        self.bulk = BulkPool(learner_id, credentials) if bulk else None
        self.host = address.rpartition(":")[0].strip("[]")

    async def join(self) -> pb.JoinResponse:
        response: pb.JoinResponse = await self.stub.Join(
            pb.JoinRequest(learner_id=self.learner_id, layout=make_layout(self.sizes)))
        self.next_seq = max(self.next_seq, response.next_seq)
        return response

    async def push(self, fragment: int, values: Floats, *, base_version: int = 0,
                   codec: Codec = FP32, init: bool = False) -> tuple[pb.PushResponse, int]:
        """Push one contribution (or initial value); returns the ack and its wire bytes."""
        seq = self.next_seq
        self.next_seq += 1
        header = pb.PushHeader(
            learner_id=self.learner_id, fragment=fragment, layout_hash=LAYOUT_HASH, seq=seq,
            base_version=base_version, c_tokens=4096, c_steps=16, codec=codec.wire,
            numel=values.size, init=init, bulk=self.bulk is not None)
        if self.bulk is None:
            count = WireCount()
            response: pb.PushResponse = await self.stub.PushFragment(
                push_messages(header, values, codec, self.chunk_bytes, count))
            return response, count.data_bytes
        pool = self.bulk
        sent = asyncio.Event()

        async def messages() -> AsyncIterator[pb.PushMessage]:
            yield pb.PushMessage(header=header)
            await sent.wait()  # the stream ends once the frames are taken

        call = self.stub.PushFragment(messages())
        initial = dict(await call.initial_metadata() or ())
        nbytes = 0
        if metadata.BULK_TICKET in initial:  # else refused: the call says why
            nbytes = await asyncio.to_thread(
                pool.push, self.host, int(initial[metadata.BULK_PORT]),
                bytes.fromhex(initial[metadata.BULK_TICKET]), values, codec)
        sent.set()
        response = await call
        return response, nbytes

    async def pull(self, fragment: int, have_version: int, out: Floats) -> Pulled:
        """Pull a version newer than `have_version` into `out`, decoding as it streams."""
        started = time.perf_counter()
        header_at = started
        version = -1
        nbytes = 0
        call = self.stub.PullFragment(pb.PullRequest(
            learner_id=self.learner_id, fragment=fragment, have_version=have_version,
            wait_ms=PULL_WAIT_MS, bulk=self.bulk is not None))
        async for message in call:
            if message.WhichOneof("kind") == "header":
                header_at = time.perf_counter()
                header = message.header
                if header.not_modified:
                    raise RuntimeError(f"fragment {fragment}: no version newer than "
                                       f"{have_version} within {PULL_WAIT_MS} ms")
                version = header.version
                if header.ticket and self.bulk is not None:
                    reader = ChunkReader(out.size, f"fragment {fragment}")
                    await asyncio.to_thread(self.bulk.pull, self.host, header.bulk_port,
                                            header.ticket, reader, out)
                    nbytes += reader.nbytes
            else:
                decode_chunk_into(message.chunk, FP32, out)
                nbytes += len(message.chunk.data)
        return Pulled(version, nbytes, header_at - started, time.perf_counter() - header_at)

    async def versions(self) -> list[int]:
        response: pb.HeartbeatResponse = await self.stub.Heartbeat(
            pb.HeartbeatRequest(learner_id=self.learner_id))
        return [f.version for f in response.fragments]

    async def wait_versions(self, at_least: int, timeout: float = 300.0) -> None:
        """Poll heartbeats until every fragment has a version >= `at_least`."""
        deadline = time.monotonic() + timeout
        while min(await self.versions()) < at_least:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fragments did not reach version {at_least}")
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        if self.bulk is not None:
            self.bulk.close()
        await self.channel.close(grace=None)


# -- the raw-socket baseline ---------------------------------------------------------

_RAW_SERVER = r"""
import socket, sys
context = None
if len(sys.argv) > 1:  # a TLS config: the bulk port's own context (protos.tls)
    from protos import tls
    context = tls.server_context(tls.load(tls.TlsConfig(*sys.argv[1:4])))
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
buffer = bytearray()


def receive(conn, view):
    got = 0
    while got < view.nbytes:
        n = conn.recv_into(view[got:], min(view.nbytes - got, 64 << 20))
        if n == 0:
            sys.exit("client went away")
        got += n


while True:
    conn, _ = server.accept()
    if context is not None:
        conn = context.wrap_socket(conn, server_side=True)
    with conn:
        head = memoryview(bytearray(8))
        receive(conn, head)
        size = int.from_bytes(head, "little")
        if size == 0:
            break
        if len(buffer) < size:
            buffer = bytearray(size)
        view = memoryview(buffer)[:size]
        receive(conn, view)
        conn.sendall(view)
"""


class RawServer:
    """A TCP echo-after-receive server in its own process; over TLS, with the bulk
    port's context, when given the coordinator's and a learner's TLS configs."""

    def __init__(self, server_tls: tls.TlsConfig | None = None,
                 client_tls: tls.TlsConfig | None = None) -> None:
        if (server_tls is None) != (client_tls is None):
            raise ValueError("over TLS the raw server needs both sides' configs")
        material = tls.load(client_tls)
        self.context = None if material is None else tls.client_context(material)
        files = [] if server_tls is None else [server_tls.cert, server_tls.key, server_tls.ca]
        self.process = subprocess.Popen([sys.executable, "-c", _RAW_SERVER, *files],
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())

    def connect(self, via: tuple[str, int] | None = None) -> socket.socket:
        conn = socket.create_connection(via or ("127.0.0.1", self.port))
        if self.context is None:
            return conn
        return self.context.wrap_socket(conn, server_hostname="127.0.0.1")

    def roundtrip(self, payload: memoryview, into: memoryview,
                  via: tuple[str, int] | None = None) -> float:
        """Send `payload` up and receive it back into `into` (through `via`, a proxy in
        front of this server, when given); returns seconds, the TLS handshake included."""
        size = payload.nbytes
        started = time.perf_counter()
        with self.connect(via) as conn:
            conn.sendall(size.to_bytes(8, "little"))
            conn.sendall(payload)
            got = 0
            while got < size:
                n = conn.recv_into(into[got:], min(size - got, 64 << 20))
                if n == 0:
                    raise RuntimeError("raw server closed early")
                got += n
        return time.perf_counter() - started

    def close(self) -> None:
        """Stop the server; killed when it will not stop (it died, or hangs), so that
        it never outlives the benchmark nor hides the error that brought us here."""
        try:
            with self.connect() as conn:
                conn.sendall((0).to_bytes(8, "little"))
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()


def raw_runs(server: RawServer, delta: Floats, sink: Floats, repeats: int) -> list[float]:
    payload = delta.data.cast("B")
    into = sink.data.cast("B")
    runs = [server.roundtrip(payload, into) for _ in range(repeats)]
    if not np.array_equal(delta[-1024:], sink[-1024:]):
        raise RuntimeError("raw socket echo corrupted the payload")
    return runs


def raw_summary(nbytes: int, before: list[float], after: list[float]) -> dict[str, Any]:
    best = min(before + after)
    return {"bytes_up": nbytes, "bytes_down": nbytes, "seconds": best,
            "runs_before_s": [round(r, 4) for r in before],
            "runs_after_s": [round(r, 4) for r in after], "mb_s": 2 * nbytes / best / MB}


# -- the gRPC floor: the same library with nothing of ours in it ------------------------

_GRPC_FLOOR_SERVER = r"""
import asyncio
import grpc

OPTIONS = [("grpc.max_receive_message_length", 8 << 20),
           ("grpc.max_send_message_length", 8 << 20)]


async def main():
    kept = []

    async def push(requests, context):
        kept.clear()
        async for message in requests:
            kept.append(message)
        return sum(map(len, kept)).to_bytes(8, "little")

    async def pull(request, context):
        for message in kept:
            yield message

    handler = grpc.method_handlers_generic_handler("bench.Echo", {
        "Push": grpc.stream_unary_rpc_method_handler(push),
        "Pull": grpc.unary_stream_rpc_method_handler(pull)})
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


async def grpc_floor_runs(port: int, delta: Floats, sink: Floats, chunk_bytes: int,
                          repeats: int) -> list[float]:
    """Push `delta` as raw `bytes` messages (no protobuf) and pull them back into `sink`."""
    raw = delta.data.cast("B")
    out = sink.data.cast("B")

    def messages() -> Iterator[bytes]:
        for start in range(0, raw.nbytes, chunk_bytes):
            yield raw[start:start + chunk_bytes].tobytes()

    runs = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                         options=CHANNEL_OPTIONS) as channel:
        push = channel.stream_unary("/bench.Echo/Push", request_serializer=None,
                                    response_deserializer=None)
        pull = channel.unary_stream("/bench.Echo/Pull", request_serializer=None,
                                    response_deserializer=None)
        for _ in range(repeats):
            started = time.perf_counter()
            await push(messages())
            offset = 0
            async for message in pull(b""):
                out[offset:offset + len(message)] = message
                offset += len(message)
            runs.append(time.perf_counter() - started)
    if offset != raw.nbytes or not np.array_equal(delta[-1024:], sink[-1024:]):
        raise RuntimeError("gRPC echo corrupted the payload")
    return runs


def measure_grpc_floor(delta: Floats, sink: Floats, chunk_bytes: int,
                       repeats: int) -> dict[str, Any]:
    server = subprocess.Popen([sys.executable, "-c", _GRPC_FLOOR_SERVER],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        runs = asyncio.run(grpc_floor_runs(port, delta, sink, chunk_bytes, repeats + 1))[1:]
    finally:
        server.terminate()
        server.wait(timeout=10)
    best = min(runs)
    return {"seconds": best, "runs_s": [round(r, 4) for r in runs],
            "mb_s": 2 * delta.nbytes / best / MB}


# -- the daemon --------------------------------------------------------------------------

async def timed_round(learner: BenchLearner, deltas: list[Floats], outs: list[Floats],
                      version: int, concurrent: bool) -> dict[str, Any]:
    """Push one contribution per fragment against `version`, pull `version + 1` back."""

    async def push(p: int) -> tuple[int, float]:
        response, nbytes = await learner.push(p, deltas[p], base_version=version)
        if response.target_version != version + 1:
            raise RuntimeError(f"fragment {p}: push joined round {response.target_version}, "
                               f"expected {version + 1}")
        return nbytes, time.perf_counter()

    async def pull(p: int) -> Pulled:
        pulled = await learner.pull(p, version, outs[p])
        if pulled.version != version + 1:
            raise RuntimeError(f"fragment {p}: pulled version {pulled.version}, "
                               f"expected {version + 1}")
        return pulled

    async def push_then_pull(p: int) -> tuple[int, float, Pulled]:
        nbytes, acked_at = await push(p)
        return nbytes, acked_at, await pull(p)

    started = time.perf_counter()
    if concurrent:
        results = await asyncio.gather(*(push_then_pull(p) for p in range(len(deltas))))
        pushed = sum(r[0] for r in results)
        pushes_done = max(r[1] for r in results)
        pulls = [r[2] for r in results]
    else:
        pushed = 0
        for p in range(len(deltas)):
            nbytes, _ = await push(p)
            pushed += nbytes
        pushes_done = time.perf_counter()
        pulls = [await pull(p) for p in range(len(deltas))]
    seconds = time.perf_counter() - started
    pulled = sum(r.data_bytes for r in pulls)
    waited = sum(r.wait_s for r in pulls)
    return {
        "mode": "concurrent" if concurrent else "sequential",
        "seconds": seconds,
        "push_s": pushes_done - started,
        "pull_wait_s": [round(r.wait_s, 4) for r in pulls],
        "pull_stream_s": [round(r.stream_s, 4) for r in pulls],
        "bytes_pushed": pushed,
        "bytes_pulled": pulled,
        "mb_s": (pushed + pulled) / seconds / MB,
        # Sequential pulls wait for each commit on the critical path; without those waits
        # this is the network path alone. Concurrent waits overlap other streams.
        "mb_s_without_commit_wait": (
            None if concurrent else (pushed + pulled) / (seconds - waited) / MB),
    }


async def codec_pushes(learner: BenchLearner, deltas: list[Floats], version: int,
                       rounds: int) -> tuple[dict[str, Any], int]:
    """Push the same outer gradient with each codec, fragments in turn, one round per push
    of the whole model; codecs alternate round by round and the best round of each counts."""
    params = sum(d.size for d in deltas)
    times: dict[str, list[float]] = {name: [] for name in CODEC_NAMES}
    wire: dict[str, int] = {}
    for _ in range(rounds):
        for name in CODEC_NAMES:
            codec = codec_named(name)
            started = time.perf_counter()
            wire[name] = 0
            for p, values in enumerate(deltas):
                _, nbytes = await learner.push(p, values, base_version=version, codec=codec)
                wire[name] += nbytes
            times[name].append(time.perf_counter() - started)
            await learner.wait_versions(version + 1)
            version += 1
    results: dict[str, Any] = {}
    for name in CODEC_NAMES:
        seconds = min(times[name])
        results[name] = {"wire_bytes": wire[name], "push_s": seconds,
                         "runs_s": [round(t, 4) for t in times[name]],
                         "params_per_s": params / seconds, "wire_mb_s": wire[name] / seconds / MB,
                         "wire_fraction_of_fp32": wire[name] / wire["fp32"],
                         "speedup_vs_fp32": min(times["fp32"]) / seconds}
        log(f"  {name}: {wire[name] / MB:.1f} MB on the wire, {seconds:.2f} s, "
            f"{params / seconds / 1e6:.1f} M params/s")
    return results, version


async def daemon_transfer(address: str, sizes: list[int], theta: Floats, delta: Floats,
                          chunk_bytes: int, rounds: int, codec_rounds: int,
                          credentials: tls.TlsMaterial | None = None) -> dict[str, Any]:
    learner = BenchLearner(address, "bench-learner", sizes, chunk_bytes, credentials)
    try:
        await learner.join()
        thetas, deltas = split(theta, sizes), split(delta, sizes)
        outs = [np.empty(n, dtype=np.float32) for n in sizes]
        log("warm-up: initial values pushed and pulled back")
        started = time.perf_counter()
        for p, values in enumerate(thetas):
            await learner.push(p, values, init=True)
        init_s = time.perf_counter() - started
        for p in range(len(sizes)):
            await learner.pull(p, -1, outs[p])
        if not np.array_equal(outs[0][:4096], thetas[0][:4096]):
            raise RuntimeError("version 0 pulled back differs from the initial value pushed")

        # Sequential and concurrent rounds alternate, so a noisy neighbour on the machine
        # hurts both alike; the best round of each mode counts.
        runs: dict[str, list[dict[str, Any]]] = {"sequential": [], "concurrent": []}
        version = 0
        for _ in range(rounds):
            for concurrent in (False, True):
                result = await timed_round(learner, deltas, outs, version, concurrent)
                if version == 0:
                    # One outer step from zero momentum: Θ1 = Θ0 − lr·(1 + μ)·Δ
                    # with Nesterov, Θ0 − lr·Δ without.
                    step = np.float32(OUTER.lr * ((1 + OUTER.momentum) if OUTER.nesterov else 1))
                    expected = thetas[0][:4096] - step * deltas[0][:4096]
                    if not np.allclose(outs[0][:4096], expected, rtol=1e-5, atol=1e-6):
                        raise RuntimeError("version 1 is not one outer step of the "
                                           "pushed outer gradient")
                version += 1
                runs[result["mode"]].append(result)
                log(f"  {result['mode']:>10}: {result['mb_s']:.0f} MB/s "
                    f"in {result['seconds']:.2f} s (push {result['push_s']:.2f} s)")
        best = {mode: max(results, key=lambda r: r["mb_s"]) for mode, results in runs.items()}
        for mode, results in runs.items():
            best[mode]["rounds_mb_s"] = [round(r["mb_s"], 1) for r in results]
        codecs: dict[str, Any] = {}
        if codec_rounds:
            log("codecs: the same outer gradient pushed with each codec")
            codecs, _ = await codec_pushes(learner, deltas, version, codec_rounds)
        return {"init_push_s": init_s, **best, "codecs": codecs}
    finally:
        await learner.close()


def secure_transfer(tmp: Path, args: argparse.Namespace, sizes: list[int], theta: Floats,
                    delta: Floats, sink: Floats) -> dict[str, Any]:
    """The timed rounds again, against a daemon that requires client certificates, and
    the raw socket's round trips over TLS with the bulk port's own contexts before and
    after them: what TLS alone costs these bytes here."""
    log("the same rounds over mutual TLS")
    make_certificates(tmp / "certs", [], ["bench-learner"])
    files = {stem: tls.TlsConfig(cert=str(tmp / "certs" / f"{stem}.pem"),
                                 key=str(tmp / "certs" / f"{stem}.key"),
                                 ca=str(tmp / "certs" / "ca.pem"))
             for stem in ("coordinator", "learner-bench-learner")}
    server = RawServer(files["coordinator"], files["learner-bench-learner"])
    sink.fill(0.0)  # what the plaintext echo left there must not pass for this one's
    try:
        raw_runs(server, delta, sink, 1)
        before = raw_runs(server, delta, sink, args.raw_repeats)
        log(f"  raw socket over TLS: {2 * delta.nbytes / min(before) / MB:.0f} MB/s")
        with daemon_environment(args.daemon_env):
            daemon = Daemon(state_dir=tmp / "state-tls", args=[
                "--set", "fsync=false", *tls.as_flags(files["coordinator"])]).start()
        try:
            result = asyncio.run(daemon_transfer(
                daemon.address, sizes, theta, delta, args.chunk_bytes, args.rounds, 0,
                tls.load(files["learner-bench-learner"])))
        finally:
            daemon.stop()
        after = raw_runs(server, delta, sink, args.raw_repeats)
        log(f"  raw socket over TLS again: {2 * delta.nbytes / min(after) / MB:.0f} MB/s")
    finally:
        server.close()
    return {**result, "socket": raw_summary(delta.nbytes, before, after)}


def tls_best(result: dict[str, Any]) -> dict[str, Any]:
    best: dict[str, Any] = max(result["sequential"], result["concurrent"],
                               key=lambda r: r["mb_s"])
    return best


# -- many learners into one round -------------------------------------------------------

_RAW_SINK = r"""
import socket, sys, threading
server = socket.create_server(("127.0.0.1", 0), backlog=64)
print(server.getsockname()[1], flush=True)

def sink(conn):
    with conn:
        size = int.from_bytes(conn.recv(8, socket.MSG_WAITALL), "little")
        view = memoryview(bytearray(16 << 20))
        got = 0
        while got < size:
            n = conn.recv_into(view, min(size - got, view.nbytes))
            if n == 0:
                sys.exit("a sender went away")
            got += n
        conn.sendall(b"\x00")

while True:
    conn, _ = server.accept()
    threading.Thread(target=sink, args=(conn,), daemon=True).start()
"""


def raw_fan_in(payload: memoryview, senders: int) -> float:
    """Seconds for `senders` threads to send `payload` each into one sink process."""
    process = subprocess.Popen([sys.executable, "-c", _RAW_SINK], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(payload.nbytes.to_bytes(8, "little"))
                conn.sendall(payload)
                if conn.recv(1) != b"\x00":
                    raise RuntimeError("the raw sink closed early")

        threads = [threading.Thread(target=send) for _ in range(senders)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - started
    finally:
        process.kill()
        process.wait()


def peak_rss_mb(pid: int) -> float:
    """The high-water mark of a process's resident memory (Linux VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    raise RuntimeError(f"no VmHWM for process {pid}")


async def fan_in_rounds(address: str, sizes: list[int], theta: Floats, delta: Floats,
                        learners: int, rounds: int) -> list[float]:
    """`learners` learners push every fragment at once into one round (closing when all
    have contributed); the seconds from the first push to the last acknowledgement."""
    crowd = [BenchLearner(address, f"bench-{i}", sizes) for i in range(learners)]
    try:
        for learner in crowd:
            await learner.join()
        thetas, deltas = split(theta, sizes), split(delta, sizes)
        for p, values in enumerate(thetas):
            await crowd[0].push(p, values, init=True)
        runs = []
        for version in range(rounds):
            started = time.perf_counter()
            acks = await asyncio.gather(*(learner.push(p, deltas[p], base_version=version)
                                          for learner in crowd for p in range(len(sizes))))
            runs.append(time.perf_counter() - started)
            if {response.target_version for response, _ in acks} != {version + 1}:
                raise RuntimeError(f"the pushes did not all join round {version + 1}")
            await crowd[0].wait_versions(version + 1)
        return runs
    finally:
        for learner in crowd:
            await learner.close()


def fan_in(args: argparse.Namespace, sizes: list[int], theta: Floats, delta: Floats) -> None:
    """Aggregate ingest of `--learners` learners against as many raw senders."""
    payload = delta.data.cast("B")
    nbytes = args.learners * delta.nbytes
    log(f"baseline: {args.learners} raw senders into one process, {delta.nbytes / MB:.0f} MB "
        f"each")
    raw = [raw_fan_in(payload, args.learners) for _ in range(args.raw_repeats)]
    log(f"  {nbytes / min(raw) / MB:.0f} MB/s")
    with tempfile.TemporaryDirectory(prefix="ftsync-bench-transfer-") as tmp:
        with daemon_environment(args.daemon_env):
            daemon = Daemon(state_dir=Path(tmp) / "state", args=[
                "--set", "fsync=false", "--set", f"policy.min_quorum={args.learners}",
                "--set", "policy.grace_max_s=0"]).start()
        try:
            assert daemon.process is not None
            runs = asyncio.run(fan_in_rounds(daemon.address, sizes, theta, delta,
                                             args.learners, args.rounds))
            peak = peak_rss_mb(daemon.process.pid)
        finally:
            daemon.stop()
    raw += [raw_fan_in(payload, args.learners) for _ in range(args.raw_repeats)]
    daemon_mb_s, raw_mb_s = nbytes / min(runs) / MB, nbytes / min(raw) / MB
    log(f"  daemon: {daemon_mb_s:.0f} MB/s (rounds {[round(r, 2) for r in runs]} s), "
        f"raw {raw_mb_s:.0f} MB/s, daemon peak RSS {peak:.0f} MB")
    model_mb = delta.nbytes / MB
    # Parameters, momentum and the open round's sum, plus the default staging: twice
    # the largest fragment.
    expected = 3 * model_mb + 2 * 4 * max(sizes) / MB
    emit({
        "name": "transfer_fan_in",
        "ratio": daemon_mb_s / raw_mb_s,
        "target": 0.7,
        "unit": "aggregate ingest ratio",
        "learners": args.learners,
        "params": args.params,
        "fragments": args.fragments,
        "mb": "1e6 bytes",
        "daemon_mb_s": daemon_mb_s,
        "raw_mb_s": raw_mb_s,
        "daemon_rounds_s": [round(r, 4) for r in runs],
        "raw_runs_s": [round(r, 4) for r in raw],
        "daemon_peak_rss_mb": peak,
        "model_mb": model_mb,
        "expected_peak_mb": expected,
        "peak_over_expected": peak / expected,
        "load_average": round(os.getloadavg()[0], 2),
    })


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "transfer benchmark")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per mode; the best counts (default 3)")
    parser.add_argument("--codec-rounds", type=int, default=2,
                        help="pushes of the whole model per codec; the best counts (default 2)")
    parser.add_argument("--daemon-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the daemon process only, e.g. "
                             "MALLOC_TRIM_THRESHOLD_=1073741824 (repeatable)")
    parser.add_argument("--tls", action="store_true",
                        help="also run the rounds against a daemon serving mutual TLS, with "
                             "certificates made for the run, and the raw socket over TLS: "
                             "report tls_ratio and tls_socket_ratio")
    parser.add_argument("--raw-repeats", type=int, default=2,
                        help="raw-socket round trips before and after the daemon's; the best "
                             "counts (default 2 each)")
    parser.add_argument("--learners", type=int, default=1,
                        help="more than 1: that many learners push one fragment set each "
                             "into one round at once, against as many raw senders into one "
                             "process (aggregate ingest; daemon peak memory)")
    args = parser.parse_args(argv)
    sizes = fragment_sizes(args.params, args.fragments)
    load_before = os.getloadavg()
    log(f"{args.params:,} fp32 parameters in {args.fragments} fragments "
        f"({4 * args.params / MB:.0f} MB); load average {load_before[0]:.2f}")
    theta, delta = make_model(args.params)
    if args.learners > 1:
        fan_in(args, sizes, theta, delta)
        return
    sink = np.empty_like(delta)

    log("baseline: raw TCP socket, same bytes up and back")
    server = RawServer()
    try:
        raw_runs(server, delta, sink, 1)  # warm-up: the server's buffer, page faults
        before = raw_runs(server, delta, sink, args.raw_repeats)
        log(f"  {2 * delta.nbytes / min(before) / MB:.0f} MB/s")
        with tempfile.TemporaryDirectory(prefix="ftsync-bench-transfer-") as tmp:
            with daemon_environment(args.daemon_env):
                daemon = Daemon(state_dir=Path(tmp) / "state",
                                args=["--set", "fsync=false"]).start()
            try:
                result = asyncio.run(daemon_transfer(daemon.address, sizes, theta, delta,
                                                     args.chunk_bytes, args.rounds,
                                                     args.codec_rounds))
            finally:
                daemon.stop()
            secured = (secure_transfer(Path(tmp), args, sizes, theta, delta, sink)
                       if args.tls else None)
        log("reference: bare gRPC echo of raw bytes messages (no protobuf, no daemon)")
        floor = measure_grpc_floor(delta, sink, args.chunk_bytes, args.raw_repeats)
        log(f"  {floor['mb_s']:.0f} MB/s")
        log("baseline again: raw TCP socket")
        after = raw_runs(server, delta, sink, args.raw_repeats)
        log(f"  {2 * delta.nbytes / min(after) / MB:.0f} MB/s")
    finally:
        server.close()
    raw = raw_summary(delta.nbytes, before, after)

    best = max(result["sequential"], result["concurrent"], key=lambda r: r["mb_s"])
    emit({
        "name": "transfer",
        "ratio": best["mb_s"] / raw["mb_s"],
        "target": 0.7,
        "unit": "throughput ratio",
        "params": args.params,
        "fragments": args.fragments,
        "chunk_bytes": args.chunk_bytes,
        "mb": "1e6 bytes",
        "daemon_mb_s": best["mb_s"],
        "raw_mb_s": raw["mb_s"],
        "headline_mode": best["mode"],
        "sequential_ratio": result["sequential"]["mb_s"] / raw["mb_s"],
        "concurrent_ratio": result["concurrent"]["mb_s"] / raw["mb_s"],
        "sequential": result["sequential"],
        "concurrent": result["concurrent"],
        "raw": raw,
        # What grpcio's asyncio stack alone achieves for the same bytes and chunk size: the
        # ceiling for any Python gRPC daemon on this machine.
        "grpc_floor_mb_s": floor["mb_s"],
        "grpc_floor_ratio": floor["mb_s"] / raw["mb_s"],
        "daemon_vs_grpc_floor": best["mb_s"] / floor["mb_s"],
        "grpc_floor": floor,
        "init_push_s": result["init_push_s"],
        "codecs": result["codecs"],
        **({} if secured is None else {
            # What security costs: the same rounds over mutual TLS, against plaintext.
            "tls_ratio": tls_best(secured)["mb_s"] / best["mb_s"],
            "tls_target": 0.8,
            "tls_mb_s": tls_best(secured)["mb_s"],
            "tls_sequential": secured["sequential"], "tls_concurrent": secured["concurrent"],
            # The same raw socket over TLS against plaintext: what OpenSSL through Python's
            # ssl costs these bytes on this machine, whatever the daemon does.
            "tls_socket_ratio": secured["socket"]["mb_s"] / raw["mb_s"],
            "tls_vs_tls_socket": tls_best(secured)["mb_s"] / secured["socket"]["mb_s"],
            "tls_socket": secured["socket"]}),
        "daemon_env": args.daemon_env,
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    })


if __name__ == "__main__":
    main()
