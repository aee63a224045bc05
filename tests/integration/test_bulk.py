"""The bulk channel against a real daemon: pushes and pulls moving their bytes on the
bulk port, the fall-back to gRPC chunks where that port cannot be reached, and every
kind of bad bulk connection refused or cut with its reason counted, nothing folded,
and the daemon serving on.

Each test starts its own coordinator on ephemeral loopback ports. The bad connections
are written byte by byte on real sockets (`protos.bulk` documents the format); the
tickets they use come from real `PushFragment` calls, read from the initial metadata
as a learner reads them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from chaos.local import StartError
from chaos.proxy import ThreadedProxy
from coordinator.certs import make_certificates
from learner.client import Retry, SynchronizerClient
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos import metadata, tls
from protos.bulk import HEAD, TICKET_BYTES, checksum
from protos.codec import INT8
from tests.daemon import Daemon, proxy_in_front, wait_until
from tests.integration.test_bad_input import free_port, metrics_text

StartDaemon = Callable[..., Daemon]

NUMEL = 1 << 20  # two frames of fp32
HASH = "bulk-layout"
INITIAL = np.random.default_rng(0).standard_normal(NUMEL).astype(np.float32)
GRADIENT = (np.random.default_rng(1).standard_normal(NUMEL) * 1e-4).astype(np.float32)
FAST = ("--set", "policy.grace_max_s=0.2")
TIMEOUT = 20.0


def transfers(port: int) -> dict[str, float]:
    """ftsync_transfers from the daemon's Prometheus page, by direction/transport."""
    counts = {}
    for line in metrics_text(port).splitlines():
        if line.startswith("ftsync_transfers_total{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1:
                                                            line.index("}")].split(","))
            key = f"{labels['direction'].strip(chr(34))}/{labels['transport'].strip(chr(34))}"
            counts[key] = float(line.rsplit(" ", 1)[1])
    return counts


def client(address: str, learner_id: str = "a", **options: Any) -> SynchronizerClient:
    return SynchronizerClient(address, learner_id, HASH, [NUMEL], **options)


async def init_and_pull(learner: SynchronizerClient) -> np.ndarray:
    await learner.join()
    assert await learner.push_initial(0, INITIAL)
    pulled = await learner.pull(0, -1, 5.0)
    assert pulled is not None
    return pulled.values


def test_a_push_and_a_pull_move_their_bytes_on_the_bulk_port(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    port = free_port()
    daemon = start_daemon(*FAST, "--prometheus-listen", str(port))

    async def scenario() -> None:
        # Pulls in fp32: a pull in int8 would take the delta on the call.
        learner = client(daemon.address, codec="int8", pull_codec="fp32")
        try:
            np.testing.assert_array_equal(await init_and_pull(learner), INITIAL)
            target = await learner.push(0, GRADIENT, 0, 1000, 10, 10)
            assert target == 1
            pulled = await learner.pull(0, 0, 10.0)
            assert pulled is not None and pulled.version == 1
            # One outer step (lr 0.7, no momentum) of the int8-coded gradient.
            sent = np.empty_like(GRADIENT)
            INT8.decode_into(*INT8.encode(GRADIENT), sent)
            np.testing.assert_allclose(pulled.values, INITIAL - 0.7 * sent,
                                       rtol=1e-5, atol=1e-6)
            assert learner._no_bulk == set()
        finally:
            await learner.close()

    asyncio.run(scenario())
    status = daemon.status()
    assert status.bytes_in == 4 * NUMEL + NUMEL  # fp32 initial value, int8 gradient
    assert status.bytes_out == 2 * 4 * NUMEL
    assert dict(status.rejections) == {}
    assert transfers(port) == {"push/bulk": 2, "pull/bulk": 2}


def test_a_fixed_bulk_port_is_the_one_the_daemon_serves_on(start_daemon: StartDaemon) -> None:
    """`bulk_port` fixes the port (for a Service or a port map to expose): the transfers
    go there, and a second daemon asking for it is refused at start, naming it."""
    port, bulk = free_port(), free_port()
    daemon = start_daemon(*FAST, "--prometheus-listen", str(port), "--set", f"bulk_port={bulk}")

    async def scenario() -> None:
        learner = client(daemon.address)
        try:
            await init_and_pull(learner)
        finally:
            await learner.close()

    asyncio.run(scenario())
    assert transfers(port) == {"push/bulk": 1, "pull/bulk": 1}
    with pytest.raises(StartError, match=f"cannot open bulk_port {bulk} on 127.0.0.1"):
        start_daemon("--set", f"bulk_port={bulk}")


def test_the_daemon_stops_at_once_while_a_learner_holds_a_pooled_bulk_connection(
        start_daemon: StartDaemon) -> None:
    """A worker thread blocked reading the pooled connection kept the process from
    exiting until the connection's idle timeout (30 s): SIGTERM then took the harness's
    SIGKILL after 15 s, and a restart in a test waited that long."""
    daemon = start_daemon(*FAST)

    async def scenario() -> None:
        learner = client(daemon.address)
        try:
            await init_and_pull(learner)  # the connection stays in the learner's pool
            assert daemon.stop() == 0, "the daemon did not exit by itself on SIGTERM"
        finally:
            await learner.close()

    asyncio.run(scenario())


def test_where_the_bulk_port_cannot_be_reached_the_bytes_go_as_grpc_chunks(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    metrics_port = free_port()
    daemon = start_daemon(*FAST, "--prometheus-listen", str(metrics_port))
    # The learner reaches the daemon's gRPC port only through a proxy on another
    # loopback address, where nothing listens on the bulk port: as behind a NAT.
    proxy = ThreadedProxy(daemon.address, host="127.0.0.2")
    port = proxy.start()
    events = tmp_path / "learner.jsonl"
    try:
        async def scenario() -> None:
            from protos.events import EventLog
            learner = client(f"127.0.0.2:{port}", events=EventLog(str(events)))
            try:
                np.testing.assert_array_equal(await init_and_pull(learner), INITIAL)
                assert await learner.push(0, GRADIENT, 0, 1000, 10, 10) == 1
                pulled = await learner.pull(0, 0, 10.0)
                assert pulled is not None and pulled.version == 1
            finally:
                await learner.close()

        asyncio.run(scenario())
    finally:
        proxy.stop()
    fallbacks = [e for e in map(json.loads, events.read_text().splitlines())
                 if e["kind"] == "bulk_fallback"]
    assert len(fallbacks) == 1, fallbacks  # said once, for the coordinator
    assert fallbacks[0]["coordinator"] == f"127.0.0.2:{port}"
    assert daemon.status().fragments[0].version == 1
    # The first push asked for bulk and fell back on its call; the rest asked for none.
    assert transfers(metrics_port) == {"push/grpc_fallback": 1, "push/grpc": 1,
                                       "pull/grpc": 2}


# -- bad bulk connections ---------------------------------------------------------------


class OpenPush:
    """A bulk push of learner a under way: its gRPC call (waiting for the frames) and
    the ticket and port its initial metadata names."""

    def __init__(self, daemon: Daemon, seq: int, base_version: int = 0) -> None:
        self.channel = grpc.insecure_channel(daemon.address)
        stub = pb_grpc.SynchronizerStub(self.channel)
        self.done = threading.Event()
        header = pb.PushHeader(learner_id="a", fragment=0, layout_hash=HASH, seq=seq,
                               base_version=base_version, c_tokens=1000, c_steps=10,
                               local_step=1, codec=pb.CODEC_FP32, numel=NUMEL, bulk=True)
        self.call = stub.PushFragment.future(self._messages(header), timeout=TIMEOUT)
        initial = dict(self.call.initial_metadata())
        self.ticket = bytes.fromhex(initial[metadata.BULK_TICKET])
        self.port = int(initial[metadata.BULK_PORT])

    def _messages(self, header: pb.PushHeader) -> Iterator[pb.PushMessage]:
        yield pb.PushMessage(header=header)
        self.done.wait(TIMEOUT)  # the stream ends once the frames are sent

    def connect(self, learner_id: str = "a", ticket: bytes | None = None) -> socket.socket:
        """A bulk connection whose hello the daemon has taken."""
        conn = socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT)
        conn.sendall(hello(self.ticket if ticket is None else ticket, learner_id))
        assert conn.recv(1) == b"\x00"
        return conn

    def result(self) -> pb.PushResponse:
        self.done.set()
        try:
            response: pb.PushResponse = self.call.result()
            return response
        finally:
            self.channel.close()


def hello(ticket: bytes, learner_id: str) -> bytes:
    return ticket + bytes([len(learner_id)]) + learner_id.encode()


def frame(values: np.ndarray, offset: int, **override: Any) -> bytes:
    """A frame of `values[offset:]`'s first 2^19 elements, fields overridable."""
    data: bytes = values[offset:offset + (1 << 19)].tobytes()
    fields = {"offset": offset, "count": len(data) // 4, "nbytes": len(data), "scale": 1.0,
              "digest": checksum(data), **override}
    return HEAD.pack(fields["offset"], fields["count"], fields["nbytes"], fields["scale"],
                     fields["digest"]) + data


def refusal(conn: socket.socket) -> str:
    """The daemon's answer to a hello it did not take: `reason: message`."""
    assert conn.recv(1) == b"\x01"
    (length,) = struct.unpack("<H", conn.recv(2, socket.MSG_WAITALL))
    return conn.recv(length, socket.MSG_WAITALL).decode()


@pytest.fixture
def initialized(start_daemon: StartDaemon, tmp_path: Path) -> Daemon:
    daemon = start_daemon(*FAST, "--event-log", str(tmp_path / "events.jsonl"))
    learner = client(daemon.address)

    async def setup() -> None:
        try:
            await init_and_pull(learner)
        finally:
            await learner.close()

    asyncio.run(setup())
    return daemon


def nothing_folded(daemon: Daemon) -> None:
    fragment = daemon.status().fragments[0]
    assert (fragment.version, list(fragment.round_learners), fragment.merged_contributions) \
        == (0, [], 0)


def push_properly(daemon: Daemon, seq: int) -> None:
    """The daemon still serves: a bulk push of learner a commits version 1."""
    push = OpenPush(daemon, seq)
    with push.connect() as conn:
        send_gradient(conn)
        assert conn.recv(1) == b"\x00"
    assert push.result().target_version == 1
    wait_until(lambda: daemon.status().fragments[0].version == 1, TIMEOUT)


def send_gradient(conn: socket.socket) -> None:
    for offset in range(0, NUMEL, 1 << 19):
        conn.sendall(frame(GRADIENT, offset))


def rejections(daemon: Daemon) -> dict[str, int]:
    return dict(daemon.status().rejections)


def test_a_ticket_nobody_issued_is_refused(initialized: Daemon) -> None:
    daemon = initialized
    port = OpenPush(daemon, seq=2).port  # (its call times out on its own; seq 2 unused)
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as conn:
        conn.sendall(hello(bytes(TICKET_BYTES), "a"))
        assert refusal(conn) == "bad_ticket: no such ticket"
    assert rejections(daemon) == {"bad_ticket": 1}
    push_properly(daemon, seq=3)


def test_a_connection_that_closes_before_its_ticket_is_counted(initialized: Daemon) -> None:
    daemon = initialized
    push = OpenPush(daemon, seq=2)
    with socket.create_connection(("127.0.0.1", push.port), timeout=TIMEOUT) as conn:
        conn.sendall(push.ticket[:5])  # then gone
    wait_until(lambda: rejections(daemon) == {"bad_ticket": 1}, TIMEOUT)
    with push.connect() as conn:  # the push's own ticket still works
        send_gradient(conn)
        assert conn.recv(1) == b"\x00"
    assert push.result().target_version == 1


def test_a_spent_ticket_is_refused(initialized: Daemon) -> None:
    daemon = initialized
    push = OpenPush(daemon, seq=2)
    with push.connect() as conn:
        send_gradient(conn)
        assert conn.recv(1) == b"\x00"
    assert push.result().target_version == 1
    with socket.create_connection(("127.0.0.1", push.port), timeout=TIMEOUT) as conn:
        conn.sendall(hello(push.ticket, "a"))
        assert refusal(conn) == "bad_ticket: the ticket is spent (each is good for one " \
                                "transfer)"
    assert rejections(daemon) == {"bad_ticket": 1}


def test_another_learners_ticket_is_refused(initialized: Daemon) -> None:
    daemon = initialized
    push = OpenPush(daemon, seq=2)
    with socket.create_connection(("127.0.0.1", push.port), timeout=TIMEOUT) as conn:
        conn.sendall(hello(push.ticket, "b"))
        assert refusal(conn) == "bad_ticket: the ticket is learner 'a''s, presented by 'b'"
    nothing_folded(daemon)
    with push.connect() as conn:  # still a's to use
        send_gradient(conn)
        assert conn.recv(1) == b"\x00"
    assert push.result().target_version == 1
    assert rejections(daemon) == {"bad_ticket": 1}


# case -> (the bytes sent after the hello, gRPC status, reason, words of the message)
BAD_FRAMES: dict[str, tuple[Callable[[], bytes], grpc.StatusCode, str, str]] = {
    "out of order": (lambda: frame(GRADIENT, 1 << 19), grpc.StatusCode.INVALID_ARGUMENT,
                     "malformed", f"chunk at offset {1 << 19}, expected offset 0"),
    "short frame": (lambda: frame(GRADIENT, 0, nbytes=(4 << 19) - 4),
                    grpc.StatusCode.INVALID_ARGUMENT, "bad_encoding",
                    f"needs {4 << 19} bytes for {1 << 19} elements, got {(4 << 19) - 4}"),
    "over-long frame": (lambda: frame(GRADIENT, 0, nbytes=(4 << 20) + 4),
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "oversize",
                        f"carries {(4 << 20) + 4} bytes; the limit is {4 << 20}"),
    "checksum mismatch": (lambda: frame(GRADIENT, 0, digest=12345),
                          grpc.StatusCode.DATA_LOSS, "corrupt",
                          "frame at offset 0 of fragment 0 fails its checksum"),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_a_bad_frame_is_refused_and_nothing_is_folded(initialized: Daemon, case: str) -> None:
    daemon = initialized
    sent, code, reason, words = BAD_FRAMES[case]
    push = OpenPush(daemon, seq=2)
    with push.connect() as conn:
        conn.sendall(sent())
        with pytest.raises(grpc.RpcError) as refused:
            push.result()
    assert refused.value.code() == code
    assert metadata.reason(refused.value) == reason
    assert words in (refused.value.details() or "")
    nothing_folded(daemon)
    assert rejections(daemon) == {reason: 1}
    push_properly(daemon, seq=2)  # the refused push's seq is not burnt


def test_a_connection_cut_mid_frame_is_counted_as_cut(initialized: Daemon,
                                                      tmp_path: Path) -> None:
    daemon = initialized
    push = OpenPush(daemon, seq=2)
    with push.connect() as conn:
        conn.sendall(frame(GRADIENT, 0)[:HEAD.size + 1000])
    with pytest.raises(grpc.RpcError) as cut:
        push.result()
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE  # learners push it again
    assert metadata.reason(cut.value) == "cut"
    nothing_folded(daemon)
    assert rejections(daemon) == {}  # cut, not refused
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["reason"] for e in events if e["kind"] == "push_cut"] == ["cut"]
    push_properly(daemon, seq=2)


def test_a_push_whose_connections_are_cut_mid_frame_is_pushed_again(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    """The learner's outbox sends a push cut on the bulk channel again, and it merges
    once; the daemon counts the cut, folds nothing of it."""
    log = tmp_path / "events.jsonl"
    daemon = start_daemon(*FAST, "--event-log", str(log))
    with proxy_in_front(daemon) as proxy:  # the bulk port mirrored: both channels cross it

        async def scenario() -> None:
            learner = client(proxy.address, retry=Retry(initial_s=0.05, max_s=0.2,
                                                         give_up_after_s=20))
            try:
                await init_and_pull(learner)
                before = proxy.describe()["bytes_up"]
                # The 4 MB push takes 4 s: 3 s to cut it after its first MB, however
                # long a busy machine keeps this loop from polling.
                proxy.set_bandwidth(1e6)
                push = asyncio.ensure_future(learner.push(0, GRADIENT, 0, 1000, 10, 10))
                async with asyncio.timeout(TIMEOUT):
                    while proxy.describe()["bytes_up"] < before + 1_000_000:
                        await asyncio.sleep(0.01)  # polling the condition, not a guess
                proxy.reset_connections()
                proxy.set_bandwidth(None)
                assert await push == 1
                assert learner.stats.repushed == 0 and learner.backlog == 1
            finally:
                await learner.close()

        asyncio.run(scenario())
    wait_until(lambda: daemon.status().fragments[0].version == 1, TIMEOUT)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["kind"] for e in events if e["kind"] in ("push_cut", "push_ack")
            and e.get("seq") == 2] == ["push_cut", "push_ack"]
    commits = [e for e in events if e["kind"] == "commit" and e["version"] == 1]
    assert [m["seq"] for m in commits[0]["manifest"]] == [2]


def test_under_mutual_tls_the_bulk_connections_are_tls_with_the_same_certificates(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    make_certificates(certs, [], ["a"])
    port = free_port()
    daemon = start_daemon(*FAST, "--prometheus-listen", str(port), "--tls-cert",
                          str(certs / "coordinator.pem"), "--tls-key",
                          str(certs / "coordinator.key"), "--tls-ca", str(certs / "ca.pem"))
    credentials = tls.load(tls.TlsConfig(cert=str(certs / "learner-a.pem"),
                                         key=str(certs / "learner-a.key"),
                                         ca=str(certs / "ca.pem")))

    async def scenario() -> None:
        learner = client(daemon.address, tls=credentials)
        try:
            np.testing.assert_array_equal(await init_and_pull(learner), INITIAL)
        finally:
            await learner.close()

    asyncio.run(scenario())
    assert transfers(port) == {"push/bulk": 1, "pull/bulk": 1}
