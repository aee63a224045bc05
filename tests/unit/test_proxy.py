"""The fault-injecting TCP proxy against a real echo server on 127.0.0.1:
forwarding, latency, bandwidth, partition/heal, reset, stop, and the
threaded wrapper the chaos harness uses; the pure parts of its wide-area link
(the delay line and the token bucket) on a clock the tests drive; the link
measured through real sockets; and `python -m chaos.proxy` with its flags."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from chaos.proxy import (
    DelayLine,
    FaultProxy,
    LinkSpec,
    ThreadedProxy,
    TokenBucket,
    control,
    listening_ports,
    parse_address,
)

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[int]:
    """An upstream that sends back whatever it reads; yields its port."""
    handlers: set[asyncio.Task[None]] = set()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def proxied_echo(link: LinkSpec | None = None) -> AsyncIterator[FaultProxy]:
    async with echo_server() as port:
        proxy = FaultProxy(("127.0.0.1", port), link=link)
        await proxy.start()
        try:
            yield proxy
        finally:
            await proxy.stop()


async def connect(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(proxy.host, proxy.port, limit=1 << 20)


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0,
                   message: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        await asyncio.sleep(0.01)


async def round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     payload: bytes = b"ping") -> float:
    started = time.monotonic()
    writer.write(payload)
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(len(payload)), 5.0) == payload
    return time.monotonic() - started


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """Whether the connection ends (EOF or reset) with no more data."""
    try:
        return await asyncio.wait_for(reader.read(1 << 16), 5.0) == b""
    except ConnectionError:
        return True


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_address("[::1]:7") == ("::1", 7)
    assert parse_address(("h", 1)) == ("h", 1)
    with pytest.raises(ValueError, match="host:port"):
        parse_address("localhost")


def test_data_passes_both_ways_unchanged_and_is_counted() -> None:
    payload = random.Random(0).randbytes(4 << 20)

    async def scenario() -> None:
        async with proxied_echo() as proxy:
            reader, writer = await connect(proxy)

            async def send() -> None:
                for start in range(0, len(payload), 1 << 18):
                    writer.write(payload[start:start + (1 << 18)])
                    await writer.drain()
                writer.write_eof()

            sending = asyncio.create_task(send())
            echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 10.0)
            await sending
            assert echoed == payload
            # Our half-close went through and the echo server's came back.
            assert await closed_by_peer(reader)
            writer.close()
            await wait_for(lambda: proxy.stats.connections_active == 0,
                           message="the proxy to drop the finished connection")
            described = proxy.describe()
            assert described["bytes_up"] == described["bytes_down"] == len(payload)
            assert described["connections_accepted"] == 1
            assert described["bytes_discarded_up"] == described["bytes_discarded_down"] == 0

    asyncio.run(scenario())


def test_latency_delays_each_direction_and_keeps_order() -> None:
    async def scenario() -> None:
        async with proxied_echo() as proxy:
            reader, writer = await connect(proxy)
            # The latency is long beside what a busy machine adds to a loopback round
            # trip, so the bounds below tell delayed from not, and overlapped from not.
            assert await round_trip(reader, writer) < 0.5
            proxy.set_latency(250)
            assert proxy.describe()["latency_ms"] == 250
            # One way each direction: the round trip takes at least twice the latency.
            assert await round_trip(reader, writer) >= 0.5
            # Many small pieces, each delayed, arrive in order and overlap in flight
            # (one after another they would take 200 × 0.25 s).
            messages = [f"{i:06d}".encode() for i in range(200)]
            started = time.monotonic()
            for message in messages:
                writer.write(message)
                await writer.drain()
                await asyncio.sleep(0)
            echoed = await asyncio.wait_for(reader.readexactly(6 * len(messages)), 5.0)
            assert echoed == b"".join(messages)
            assert 0.5 <= time.monotonic() - started < 5.0
            proxy.set_latency(0)
            assert await round_trip(reader, writer) < 0.5
            writer.close()

    asyncio.run(scenario())


def test_bandwidth_cap_paces_a_transfer() -> None:
    payload = random.Random(1).randbytes(2_000_000)

    async def scenario() -> None:
        async with proxied_echo() as proxy:
            reader, writer = await connect(proxy)
            proxy.set_bandwidth(1_000_000)
            # Both directions are capped, but they overlap: ≈ 2 MB / 1 MB/s, where one
            # direction after the other would take 4 s.
            elapsed = await round_trip(reader, writer, payload)
            assert 1.6 <= elapsed <= 3.2, elapsed
            proxy.set_bandwidth(None)
            assert await round_trip(reader, writer, payload) < 1.0
            writer.close()

    asyncio.run(scenario())


def test_partition_blackholes_and_heal_resets_so_new_connections_work() -> None:
    async def scenario() -> None:
        async with proxied_echo() as proxy:
            reader, writer = await connect(proxy)
            await round_trip(reader, writer)
            proxy.partition()
            writer.write(b"lost")
            await writer.drain()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.3)
            # New connections are accepted but blackholed as well.
            reader2, writer2 = await connect(proxy)
            writer2.write(b"lost too")
            await writer2.drain()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader2.read(1), 0.3)
            described = proxy.describe()
            assert described["partitioned"] is True
            await wait_for(lambda: proxy.stats.bytes_discarded_up == len(b"lostlost too"),
                           message="the proxy to discard what was sent")
            proxy.heal()
            # The blackholed connections are reset, not resumed mid-stream.
            assert await closed_by_peer(reader)
            assert await closed_by_peer(reader2)
            reader3, writer3 = await connect(proxy)
            await round_trip(reader3, writer3)
            for w in (writer, writer2, writer3):
                w.close()

    asyncio.run(scenario())


def test_reset_aborts_current_connections_only() -> None:
    async def scenario() -> None:
        async with proxied_echo() as proxy:
            reader, writer = await connect(proxy)
            await round_trip(reader, writer)
            proxy.reset_connections()
            assert await closed_by_peer(reader)
            await wait_for(lambda: proxy.stats.connections_active == 0,
                           message="the reset connection to go")
            reader2, writer2 = await connect(proxy)
            await round_trip(reader2, writer2)
            assert proxy.stats.connections_reset == 1
            assert proxy.stats.connections_accepted == 2
            writer.close()
            writer2.close()

    asyncio.run(scenario())


def test_faults_compose() -> None:
    async def scenario() -> None:
        async with proxied_echo() as proxy:
            reader, writer = await connect(proxy)
            proxy.set_latency(50)
            proxy.set_bandwidth(1_000_000)
            # 200 kB at 1 MB/s plus 2 × 50 ms: at least what either alone would cost
            # (0.2 s, 0.1 s) with both in force; the ceiling only catches a stall (a
            # busy machine stretches the round trip, it cannot shorten it).
            elapsed = await round_trip(reader, writer, b"z" * 200_000)
            assert 0.25 <= elapsed < 3.0, elapsed
            writer.close()

    asyncio.run(scenario())


def test_an_unreachable_upstream_closes_the_connection() -> None:
    async def scenario() -> None:
        with socket.socket() as unused:
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        proxy = FaultProxy(f"127.0.0.1:{port}")
        await proxy.start()
        reader, writer = await connect(proxy)
        assert await closed_by_peer(reader)
        await wait_for(lambda: proxy.stats.connect_failures == 1, message="connect failure")
        writer.close()
        await proxy.stop()

    asyncio.run(scenario())


def test_stop_closes_listener_and_connections_and_leaves_nothing_running() -> None:
    async def scenario() -> None:
        async with echo_server() as upstream:
            proxy = FaultProxy(("127.0.0.1", upstream))
            port = await proxy.start()
            reader, writer = await connect(proxy)
            await round_trip(reader, writer)
            proxy.set_latency(20)
            writer.write(b"in flight")
            await proxy.stop()
            assert await closed_by_peer(reader)
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.1", port)
            assert proxy.stats.connections_active == 0
            assert asyncio.all_tasks() == {asyncio.current_task()}
            writer.close()

    asyncio.run(scenario())


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):
            while data := self.request.recv(1 << 16):
                self.request.sendall(data)


def test_threaded_proxy_serves_synchronous_callers() -> None:
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo) as echo:
        echo.daemon_threads = True
        serving = threading.Thread(target=echo.serve_forever, kwargs={"poll_interval": 0.05})
        serving.start()
        proxy = ThreadedProxy(f"127.0.0.1:{echo.server_address[1]}")
        try:
            port = proxy.start()
            assert proxy.address == f"127.0.0.1:{port}"
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                client.sendall(b"hello")
                assert client.recv(5) == b"hello"
                proxy.set_latency(30)
                started = time.monotonic()
                client.sendall(b"again")
                assert client.recv(5) == b"again"
                assert time.monotonic() - started >= 0.06
                proxy.set_latency(0)
                proxy.partition()
                assert proxy.describe()["partitioned"] is True
                client.sendall(b"lost")
                client.settimeout(0.2)
                with pytest.raises(TimeoutError):
                    client.recv(1)
                proxy.heal()
                client.settimeout(5)
                with contextlib.suppress(ConnectionError):
                    assert client.recv(1) == b""
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                client.sendall(b"ok")
                assert client.recv(2) == b"ok"
                proxy.set_bandwidth(10_000_000)
                proxy.reset_connections()
                with contextlib.suppress(ConnectionError):
                    assert client.recv(1) == b""
            stats = proxy.describe()
            assert stats["connections_accepted"] == 2 and stats["connections_reset"] == 2
            assert stats["bandwidth_bytes_per_s"] == 10_000_000
        finally:
            proxy.stop()
            echo.shutdown()
            serving.join(10)
    assert not any(t.name.startswith("fault-proxy") for t in threading.enumerate())
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    proxy.stop()  # a second stop is harmless


# -- the wide-area link: pure parts on a driven clock ---------------------------------------

def test_link_spec_refuses_bad_values_naming_them() -> None:
    assert LinkSpec().bandwidth is None
    assert LinkSpec(25, 125e6).bandwidth == 125e6
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="latency_ms must be >= 0 and finite"):
            LinkSpec(latency_ms=bad)
        with pytest.raises(ValueError, match="bandwidth_bytes_s must be >= 0 and finite"):
            LinkSpec(bandwidth_bytes_s=bad)


def test_faults_refuse_bad_values_and_change_nothing() -> None:
    proxy = FaultProxy("127.0.0.1:1", link=LinkSpec(10, 1e6))
    calls: list[Callable[[], None]] = [
        lambda: proxy.set_latency(-5), lambda: proxy.set_latency(math.nan),
        lambda: proxy.set_bandwidth(-1), lambda: proxy.set_bandwidth(math.inf)]
    for call in calls:
        with pytest.raises(ValueError, match="must be >= 0 and finite"):
            call()
    described = proxy.describe()
    assert described["latency_ms"] == 10 and described["bandwidth_bytes_per_s"] == 1e6


def test_delay_line_overlaps_the_delays_of_pieces_in_flight() -> None:
    line: DelayLine[int] = DelayLine(limit_bytes=1 << 20)
    # A hundred pieces read 1 ms apart on a 50 ms link: each is due 50 ms after
    # it was read, not 50 ms after the one before it was delivered.
    for i in range(100):
        assert line.put(i, 1000, now=i / 1000, latency_s=0.05) == pytest.approx(0.05 + i / 1000)
    assert line.held_bytes == 100_000 and len(line) == 100
    head = line.peek()
    assert head is not None and head[1] == 0 and head[0] == pytest.approx(0.05)
    delivered = [line.pop() for _ in range(100)]
    assert [item for _, item in delivered] == list(range(100))
    assert delivered[-1][0] == pytest.approx(0.149)  # all of it in 0.15 s, not 5 s
    assert line.held_bytes == 0 and line.peek() is None


def test_delay_line_keeps_order_when_the_latency_drops_and_reports_full() -> None:
    line: DelayLine[str] = DelayLine(limit_bytes=3000)
    line.put("slow", 1000, now=0.0, latency_s=0.2)
    # Lowered mid-stream: the next piece may not overtake the one ahead of it.
    assert line.put("fast", 1000, now=0.01, latency_s=0.0) == pytest.approx(0.2)
    assert not line.full
    line.put("third", 1000, now=0.3, latency_s=0.0)
    assert line.full
    assert line.pop() == (pytest.approx(0.2), "slow")
    assert not line.full


def test_token_bucket_paces_takers_at_the_rate_in_aggregate() -> None:
    bucket = TokenBucket(100_000, now=0.0)
    burst = bucket.burst
    assert burst == max(4096, 100_000 * 0.005)
    assert bucket.take(int(burst), now=0.0) == 0.0  # the burst goes at once
    # Then two takers at the same instant each wait for the debt they see: in turn.
    assert bucket.take(10_000, now=0.0) == pytest.approx(0.1)
    assert bucket.take(10_000, now=0.0) == pytest.approx(0.2)
    # Once the debt is paid by the clock, pacing goes on at the rate: 1 MB takes
    # 10 s of the clock, whatever the slice size.
    now, sent = 0.2, 0
    while sent < 1_000_000:
        now += bucket.take(5000, now)
        sent += 5000
    assert now == pytest.approx(0.2 + 1_000_000 / 100_000, rel=0.01)
    # Idle time refills no more than the burst.
    assert bucket.take(int(burst), now=now + 60) == 0.0
    assert bucket.take(10_000, now=now + 60) == pytest.approx(0.1)


def test_token_bucket_without_a_cap_never_waits() -> None:
    bucket = TokenBucket(None)
    assert bucket.rate is None and bucket.burst == 0
    assert bucket.take(1 << 30, now=0.0) == 0.0
    bucket.set_rate(1000, now=5.0)
    assert bucket.take(int(bucket.burst) + 1000, now=5.0) == pytest.approx(1.0)
    bucket.set_rate(0, now=6.0)
    assert bucket.take(1 << 30, now=6.0) == 0.0


# -- the wide-area link measured through real sockets --------------------------------------

def test_a_configured_link_delays_and_caps_both_directions_without_serialising() -> None:
    latency_ms, rate = 40.0, 2_000_000.0
    payload = random.Random(2).randbytes(600_000)

    async def scenario() -> None:
        async with proxied_echo(LinkSpec(latency_ms, rate)) as proxy:
            assert proxy.describe()["link"] == {"latency_ms": latency_ms,
                                                "bandwidth_bytes_s": rate}
            reader, writer = await connect(proxy)
            # A small message crosses the link twice: at least a round trip.
            assert await round_trip(reader, writer) >= 2 * latency_ms / 1000
            # A transfer echoed back: each direction at most the cap (the whole
            # echo can be no faster than the bytes at the cap, plus a round
            # trip), give or take one burst of the bucket.
            elapsed = await round_trip(reader, writer, payload)
            burst = TokenBucket(rate).burst
            assert (len(payload) - burst) / elapsed <= rate * 1.1, elapsed
            assert elapsed >= 2 * latency_ms / 1000
            proxy.set_latency(0)
            proxy.set_bandwidth(None)
            proxy.restore_link()
            assert proxy.describe()["latency_ms"] == latency_ms
            assert proxy.describe()["bandwidth_bytes_per_s"] == rate
            writer.close()

    asyncio.run(scenario())


def test_latency_does_not_cost_throughput() -> None:
    # 8 MiB in 64 KiB reads on a 50 ms link: were the pieces serialised behind
    # each other's delay, this would take 128 x 50 ms = 6.4 s each way.
    payload = random.Random(3).randbytes(8 << 20)

    async def scenario() -> None:
        async with proxied_echo(LinkSpec(latency_ms=50)) as proxy:
            reader, writer = await connect(proxy)

            async def send() -> None:
                writer.write(payload)
                await writer.drain()

            started = time.monotonic()
            sending = asyncio.create_task(send())
            echoed = await asyncio.wait_for(reader.readexactly(len(payload)), 20.0)
            elapsed = time.monotonic() - started
            await sending
            assert echoed == payload
            assert 0.1 <= elapsed < 3.0, elapsed
            writer.close()

    asyncio.run(scenario())


def test_the_proxy_process_takes_its_link_from_flags_and_refuses_bad_ones() -> None:
    base = [sys.executable, "-m", "chaos.proxy", "--listen", "127.0.0.1:0",
            "--upstream", "127.0.0.1:1", "--control"]
    for flags, named in ((["--latency-ms", "-3"], "latency_ms must be >= 0"),
                         (["--bandwidth-bytes-s", "nan"], "bandwidth_bytes_s must be >= 0"),
                         (["--latency-ms", "fast"], "invalid float value"),
                         (["--mirror-port", "7"], "other than the upstream's"),
                         (["--mirror-port", "0"], "not a port")):
        refused = subprocess.run([*base, "127.0.0.1:0", *flags], capture_output=True,
                                 text=True, timeout=30)
        assert refused.returncode == 2 and named in refused.stderr, refused.stderr
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        control_address = f"127.0.0.1:{probe.getsockname()[1]}"
    process = subprocess.Popen([*base, control_address, "--latency-ms", "25",
                                "--bandwidth-bytes-s", "125000000"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert "25 ms one way and 125000000.0 bytes/s" in process.stdout.readline()
        answer = control(control_address, "describe")
        assert answer["link"] == {"latency_ms": 25.0, "bandwidth_bytes_s": 125e6}
        assert answer["latency_ms"] == 25 and answer["bandwidth_bytes_per_s"] == 125e6
        control(control_address, "latency 0")
        with pytest.raises(RuntimeError, match="latency_ms must be >= 0"):
            control(control_address, "latency -1")
        assert control(control_address, "restore")["latency_ms"] == 25
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_mirrored_ports_of_the_upstream_host_cross_the_same_link() -> None:
    async def scenario() -> None:
        async with echo_server() as main, echo_server() as second:
            with pytest.raises(ValueError, match="other than the upstream's"):
                FaultProxy(("127.0.0.1", main), mirror_ports=(second,))
            with pytest.raises(ValueError, match="not a port"):
                FaultProxy(("127.0.0.1", main), host="127.0.0.2", mirror_ports=(0,))
            assert {main, second} <= set(listening_ports(os.getpid()))
            proxy = FaultProxy(("127.0.0.1", main), host="127.0.0.2", mirror_ports=(second,),
                               link=LinkSpec(latency_ms=30))
            await proxy.start()
            try:
                # "The coordinator's host, port N" is the proxy's host at the same number.
                reader, writer = await asyncio.open_connection("127.0.0.2", second)
                assert await round_trip(reader, writer) >= 0.06
                main_reader, main_writer = await connect(proxy)
                assert await round_trip(main_reader, main_writer) >= 0.06
                proxy.partition()
                main_writer.write(b"cut")
                writer.write(b"cut too")
                await asyncio.gather(main_writer.drain(), writer.drain())
                await wait_for(lambda: proxy.stats.bytes_discarded_up == len(b"cutcut too"),
                               message="both routes to be cut by one partition")
                assert proxy.describe()["mirror_ports"] == [second]
                assert proxy.describe()["connections_by_port"] == {str(main): 1, str(second): 1}
                assert proxy.stats.connections_accepted == 2
                writer.close()
                main_writer.close()
            finally:
                await proxy.stop()
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.2", second)

    asyncio.run(scenario())


QUICKSTART = Path(__file__).parents[2] / "experiments" / "quickstart.toml"


def test_a_link_fault_heals_back_to_the_experiments_link(tmp_path: Path) -> None:
    """Through the harness's fault table: a latency or bandwidth fault on a learner's
    proxy, then its heal, which goes back to the experiment's own link, not to none."""
    from chaos.cluster import make_cluster
    from chaos.experiment import Action, FaultSpec, load_experiment

    link = LinkSpec(latency_ms=25, bandwidth_bytes_s=12_500_000)
    experiment = dataclasses.replace(load_experiment(QUICKSTART), link=link)
    cluster = make_cluster(experiment, tmp_path)
    slot = cluster.learners[0]
    latency = FaultSpec("latency", target=slot.learner_id, at_s=1, latency_ms=200)
    bandwidth = FaultSpec("bandwidth", target=slot.learner_id, at_s=1, bandwidth_bytes_s=1000)
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo) as echo, \
            ThreadedProxy(f"127.0.0.1:{echo.server_address[1]}", link=link) as proxy:
        slot.proxy = proxy
        for fault in (latency, bandwidth):
            cluster.apply(Action(1, fault, slot.learner_id, heal=False, occurrence=0))
        assert proxy.describe()["latency_ms"] == 200
        assert proxy.describe()["bandwidth_bytes_per_s"] == 1000
        for fault in (latency, bandwidth):
            cluster.apply(Action(2, fault, slot.learner_id, heal=True, occurrence=0))
        assert proxy.describe()["latency_ms"] == 25
        assert proxy.describe()["bandwidth_bytes_per_s"] == 12_500_000
    cluster.events.close()
    details = [json.loads(line)["detail"] for line in
               (tmp_path / "harness.events.jsonl").read_text().splitlines()]
    assert details == ["200 ms", "1000 B/s", "", ""]
