"""A fault-injecting TCP proxy: the chaos harness's network faults.

The kernel here has no netem, so the chaos harness's process backend puts one
`ThreadedProxy` between each learner and the coordinator (the learner dials
the proxy's port, the proxy dials the coordinator) and injects latency,
bandwidth caps, partitions and connection resets by switching faults on that
proxy at runtime. Faults compose: latency delays each piece, the bandwidth
cap paces what is due, a partition discards everything. With no fault active
the proxy only copies bytes, with large buffers and backpressure, fast enough
for gRPC pushes of hundreds of MB/s. `FaultProxy` runs on the caller's asyncio
loop; `ThreadedProxy` runs one on its own loop in a background thread for
synchronous callers such as the chaos harness. `python -m chaos.proxy` runs
one as a process of its own (the docker backend runs it in a container beside
the learner it serves), switched by one-line commands on a control port.

A `LinkSpec` (one-way latency and a bandwidth cap, from an experiment file or
the CLI flags) makes the proxy a wide-area link from the start, as
`bench/wan.py` and `bench/convergence.py --wan` use it; faults switch away from
it and healing returns to it. The link is a `DelayLine` (each piece due a
latency after it was read, so bytes in flight overlap their delays and
throughput is kept) followed by a `TokenBucket` per direction; both are pure
(the time is passed in) and the asyncio pumps are their shell.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from protos.settings import check

__all__ = ["DelayLine", "FaultProxy", "LinkSpec", "ProxyStats", "ThreadedProxy",
           "TokenBucket", "control", "listening_ports", "parse_address"]

T = TypeVar("T")

# One read from a socket; also the StreamReader's limit, so its transport
# pauses reading only once 2 × this is buffered.
_READ_BYTES = 64 << 10
_STREAM_LIMIT = 1 << 20
# Bytes one direction of one connection may hold between reading and writing
# (pieces waiting out their latency); past it the reader stops reading and TCP
# pushes back on the sender. Caps throughput under latency at this / latency.
_IN_FLIGHT_BYTES = 16 << 20
# Under a bandwidth cap a link holds what it carries in two of its latencies,
# at least this: more would only queue in front of later calls (bufferbloat).
_CAPPED_IN_FLIGHT_MIN = 256 << 10
# Write buffer before `drain()` waits: enough to keep the socket busy.
_WRITE_HIGH_WATER = 4 << 20
# Under a bandwidth cap, pieces go out in slices of this many seconds' worth,
# so a low cap paces smoothly instead of in 64 KiB bursts; also the burst.
_PACING_S = 0.005
_MIN_SLICE = 4 << 10


def parse_address(address: str | tuple[str, int]) -> tuple[str, int]:
    """`"host:port"` or `(host, port)` as `(host, port)`."""
    if isinstance(address, tuple):
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"upstream address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on (Linux `/proc`): what a proxy in
    front of it mirrors so that every connection to it crosses the link,
    whatever ports its protocol hands out."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


@dataclass
class ProxyStats:
    """Counters since start; `up` is learner → coordinator, `down` the reverse."""

    connections_accepted: int = 0
    connections_active: int = 0
    connections_reset: int = 0
    connect_failures: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    bytes_discarded_up: int = 0
    bytes_discarded_down: int = 0


@dataclass(frozen=True)
class LinkSpec:
    """A wide-area link the proxy emulates from the start: `latency_ms` one way
    in each direction (a round trip costs twice that) and `bandwidth_bytes_s`
    in each direction, shared by all of the proxy's connections (0: no cap)."""

    latency_ms: float = 0.0
    bandwidth_bytes_s: float = 0.0

    def __post_init__(self) -> None:
        check(self, [
            (math.isfinite(self.latency_ms) and self.latency_ms >= 0, "latency_ms",
             "must be >= 0 and finite"),
            (math.isfinite(self.bandwidth_bytes_s) and self.bandwidth_bytes_s >= 0,
             "bandwidth_bytes_s", "must be >= 0 and finite, 0 for no cap"),
        ])

    @property
    def bandwidth(self) -> float | None:
        """The cap in bytes per second, None for none."""
        return self.bandwidth_bytes_s or None


class TokenBucket:
    """Paces one direction of the whole proxy (all connections share it).

    Takers may run into debt: each one waits until the debt it sees is paid,
    so concurrent takers are served at the rate in aggregate, in turn. Pure:
    the caller passes the time and does the waiting.
    """

    def __init__(self, bytes_per_s: float | None = None, now: float = 0.0) -> None:
        self.rate: float | None = None
        self._tokens = 0.0
        self._stamp = 0.0
        self.set_rate(bytes_per_s, now)

    def set_rate(self, bytes_per_s: float | None, now: float) -> None:
        self.rate = float(bytes_per_s) if bytes_per_s else None
        self._tokens = self.burst
        self._stamp = now

    @property
    def burst(self) -> float:
        """Bytes that may go at once: `_PACING_S` worth, at least `_MIN_SLICE`."""
        return 0.0 if self.rate is None else max(_MIN_SLICE, self.rate * _PACING_S)

    def take(self, n: int, now: float) -> float:
        """Spend `n` bytes' tokens at `now`; the seconds the taker must wait
        before sending them (0 when the bucket held enough, or with no cap)."""
        rate = self.rate
        if rate is None:
            return 0.0
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * rate) - n
        self._stamp = now
        return -self._tokens / rate if self._tokens < 0 else 0.0


class DelayLine(Generic[T]):
    """Pieces in order, each due `latency_s` after it was put: the pieces in
    flight wait out their delays side by side, not one after another, so a
    latency costs time once per piece's journey and no throughput. A piece is
    never due before the one ahead of it (a latency lowered mid-stream keeps
    the order). Pure: the caller passes the time; `size` counts towards
    `limit_bytes`, past which `full` tells the reader to stop."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._items: deque[tuple[float, T, int]] = deque()
        self._bytes = 0
        self._last_due = -math.inf

    def put(self, item: T, size: int, now: float, latency_s: float) -> float:
        """Add `item` read at `now`; returns when it is due."""
        due = max(now + latency_s, self._last_due)
        self._last_due = due
        self._items.append((due, item, size))
        self._bytes += size
        return due

    def pop(self) -> tuple[float, T]:
        """The next piece and when it is due (it may not be yet)."""
        due, item, size = self._items.popleft()
        self._bytes -= size
        return due, item

    def peek(self) -> tuple[float, T] | None:
        """The next piece and when it is due, left in line; None when empty."""
        return self._items[0][:2] if self._items else None

    @property
    def held_bytes(self) -> int:
        return self._bytes

    @property
    def full(self) -> bool:
        return self._bytes >= self.limit_bytes

    def __len__(self) -> int:
        return len(self._items)


class _Pipe:
    """The asyncio shell of one direction's `DelayLine`: one reader puts (and
    waits while the line is full), one writer takes (and waits while it is
    empty). `None` for data means end of stream."""

    def __init__(self, limit_bytes: Callable[[], int]) -> None:
        self._limit_bytes = limit_bytes
        self._line: DelayLine[bytes | None] = DelayLine(limit_bytes())
        self._not_empty = asyncio.Event()
        self._not_full = asyncio.Event()
        self._not_full.set()

    def _full(self) -> bool:
        self._line.limit_bytes = self._limit_bytes()  # the link may have changed
        return self._line.full

    async def put(self, now: float, latency_s: float, data: bytes | None) -> None:
        while self._full():
            self._not_full.clear()
            await self._not_full.wait()
        self._line.put(data, len(data) if data else 0, now, latency_s)
        self._not_empty.set()

    async def get(self) -> tuple[float, bytes | None]:
        while not self._line:
            self._not_empty.clear()
            await self._not_empty.wait()
        due, data = self._line.pop()
        if not self._full():
            self._not_full.set()
        return due, data

    def ready(self, now: float) -> bool:
        """Whether the next piece is due by `now` (and is data, not the end)."""
        head = self._line.peek()
        return head is not None and head[0] <= now and head[1] is not None


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, not a FIN: the peer sees ECONNRESET, as from a middlebox."""
    transport = writer.transport
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _Connection:
    """One accepted connection and, unless blackholed from the start, its upstream."""

    def __init__(self, client: asyncio.StreamWriter, handler: asyncio.Task[None]) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.handler = handler
        self.pumps: list[asyncio.Task[None]] = []
        # Set by a partition; a blackholed connection never forwards again and
        # is reset at heal (see FaultProxy.heal).
        self.blackholed = False
        self.aborted = False

    def abort(self) -> None:
        """RST both sides and stop pumping; the handler then finishes by itself."""
        self.aborted = True
        for writer in (self.client, self.upstream):
            if writer is not None:
                _abort(writer)
        for task in self.pumps:
            task.cancel()


class FaultProxy:
    """Forwards connections on `host:port` to `upstream`, with switchable faults.

    Use on a running asyncio loop: `port = await proxy.start()`, then the fault
    methods (plain methods, to be called on that loop's thread), then
    `await proxy.stop()`. From other threads use `ThreadedProxy`.

    `mirror_ports` are further ports of the upstream's host that the proxy
    carries over the same link and faults, each listened on at the same number
    on `host`: a client told to open a second connection to "the coordinator's
    host, port N" (the bulk channel's ticket names only a port) reaches it
    through the proxy. `host` must then be another address than the
    upstream's (e.g. 127.0.0.2 for an upstream on 127.0.0.1), or the ports clash.
    """

    def __init__(self, upstream: str | tuple[str, int], *, host: str = "127.0.0.1",
                 port: int = 0, link: LinkSpec | None = None,
                 mirror_ports: tuple[int, ...] = ()) -> None:
        self.upstream = parse_address(upstream)
        self.host = host
        self.port = port
        self.mirror_ports = tuple(mirror_ports)
        bad = [p for p in self.mirror_ports if not 0 < p < 65536]
        if bad:
            raise ValueError(f"mirrored port {bad[0]} is not a port (1..65535)")
        if self.mirror_ports and host == self.upstream[0]:
            raise ValueError(f"mirrored ports need a proxy host other than the upstream's "
                             f"({host}): listen on another address, e.g. 127.0.0.2")
        self.link = link or LinkSpec()
        self.stats = ProxyStats()
        self._latency_s = self.link.latency_ms / 1000.0
        self._bandwidth = self.link.bandwidth
        self._partitioned = False
        self._stopping = False
        self._buckets = {"up": TokenBucket(self._bandwidth), "down": TokenBucket(self._bandwidth)}
        self._connections: set[_Connection] = set()
        # Connections accepted per upstream port: which route carried what.
        self._accepted_by_port: dict[int, int] = {}
        self._servers: list[asyncio.Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> int:
        """Listen; returns the port (the ephemeral one if constructed with 0)."""
        self._loop = asyncio.get_running_loop()
        for bucket in self._buckets.values():  # full from now, on this loop's clock
            bucket.set_rate(self._bandwidth, self._now())
        upstream_host = self.upstream[0]
        routes = [(self.port, self.upstream),
                  *((port, (upstream_host, port)) for port in self.mirror_ports)]
        try:
            for listen_port, upstream in routes:
                self._servers.append(await asyncio.start_server(
                    functools.partial(self._handle, upstream), self.host, listen_port,
                    limit=_STREAM_LIMIT))
        except OSError:
            for server in self._servers:
                server.close()
            self._servers.clear()
            raise
        self.port = self._servers[0].sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Close the listener and every connection; nothing is left running."""
        self._stopping = True
        for server in self._servers:
            server.close()
        # A connection accepted just before the listener closed registers late.
        while self._connections:
            connections = list(self._connections)
            for connection in connections:
                connection.abort()
            handlers = [c.handler for c in connections]
            # Aborted connections end at once; cancel is the backstop.
            _, pending = await asyncio.wait(handlers, timeout=5.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()

    # -- faults -----------------------------------------------------------------------

    def set_latency(self, ms: float) -> None:
        """Delay every piece by `ms`, one way, in each direction (RTT grows by 2 × ms).

        Pieces already read keep the delay they were read under; order is kept.
        """
        self._latency_s = LinkSpec(latency_ms=ms).latency_ms / 1000.0

    def set_bandwidth(self, bytes_per_s: float | None) -> None:
        """Cap each direction at `bytes_per_s`, across all of this proxy's
        connections together (one proxy models one learner's link); 0 or None
        lifts the cap."""
        self._bandwidth = LinkSpec(bandwidth_bytes_s=bytes_per_s or 0.0).bandwidth
        now = self._now()
        for bucket in self._buckets.values():
            bucket.set_rate(self._bandwidth, now)

    def partition(self) -> None:
        """Blackhole: every connection, current or new, silently discards what
        it reads in both directions, like a cut cable; peers see no error, so
        their calls hang until a deadline or keepalive gives up. Bytes already
        handed to a socket (at most its 4 MiB write buffer) still go out."""
        self._partitioned = True
        for connection in self._connections:
            connection.blackholed = True

    def heal(self) -> None:
        """Forward again, and reset every connection that was blackholed.

        A real cable cut loses nothing: TCP retransmits once it is mended. Our
        partition discarded bytes in the middle of streams, so those streams
        (HTTP/2 frames) are corrupt and must not resume; resetting them also
        lets gRPC reconnect at once instead of hanging until a deadline.
        """
        self._partitioned = False
        for connection in [c for c in self._connections if c.blackholed]:
            self._reset(connection)

    def reset_connections(self) -> None:
        """Abort every current connection with an RST (both sides); new ones
        proceed normally."""
        for connection in list(self._connections):
            self._reset(connection)

    def restore_link(self) -> None:
        """Latency and bandwidth back to the link the proxy was made with."""
        self.set_latency(self.link.latency_ms)
        self.set_bandwidth(self.link.bandwidth)

    @property
    def partitioned(self) -> bool:
        return self._partitioned

    def describe(self) -> dict[str, Any]:
        """Where it listens, what it forwards to, the active faults and the stats."""
        return {
            "listen": self.address,
            "upstream": f"{self.upstream[0]}:{self.upstream[1]}",
            "mirror_ports": list(self.mirror_ports),
            "connections_by_port": {str(p): n for p, n in self._accepted_by_port.items()},
            "link": asdict(self.link),
            "latency_ms": self._latency_s * 1000.0,
            "bandwidth_bytes_per_s": self._bandwidth,
            "partitioned": self._partitioned,
            **asdict(self.stats),
        }

    # -- forwarding -------------------------------------------------------------------

    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else 0.0

    def _in_flight_limit(self) -> int:
        if self._bandwidth is None:
            return _IN_FLIGHT_BYTES
        carried = 2 * self._bandwidth * self._latency_s + self._buckets["up"].burst
        return min(_IN_FLIGHT_BYTES, max(_CAPPED_IN_FLIGHT_MIN, int(carried)))

    def _reset(self, connection: _Connection) -> None:
        if not connection.aborted:
            self.stats.connections_reset += 1
            connection.abort()

    async def _handle(self, upstream: tuple[str, int], client_reader: asyncio.StreamReader,
                      client_writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        connection = _Connection(client_writer, handler)
        self._connections.add(connection)
        self.stats.connections_accepted += 1
        self._accepted_by_port[upstream[1]] = self._accepted_by_port.get(upstream[1], 0) + 1
        self.stats.connections_active += 1
        if self._stopping:
            connection.abort()
        try:
            await self._serve(connection, client_reader, upstream)
        except OSError:
            # A reset or refusal on either side: the connection is over.
            connection.abort()
        finally:
            self._connections.discard(connection)
            self.stats.connections_active -= 1
            for writer in (connection.client, connection.upstream):
                if writer is not None:
                    writer.close()

    async def _serve(self, connection: _Connection, client_reader: asyncio.StreamReader,
                     upstream: tuple[str, int]) -> None:
        if connection.aborted:
            return
        if self._partitioned:
            # A cut cable: the connection never reaches upstream. Read and
            # discard until heal resets it or the client gives up.
            connection.blackholed = True
            while data := await client_reader.read(_READ_BYTES):
                self.stats.bytes_discarded_up += len(data)
            return
        host, port = upstream
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                host, port, limit=_STREAM_LIMIT)
        except OSError:
            self.stats.connect_failures += 1
            connection.abort()
            return
        connection.upstream = upstream_writer
        if connection.aborted:  # reset or healed while we were connecting
            _abort(upstream_writer)
            return
        for writer in (connection.client, upstream_writer):
            writer.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        up, down = _Pipe(self._in_flight_limit), _Pipe(self._in_flight_limit)
        pumps = [
            asyncio.create_task(self._receive(connection, client_reader, up, "up")),
            asyncio.create_task(self._deliver(connection, up, upstream_writer, "up")),
            asyncio.create_task(self._receive(connection, upstream_reader, down, "down")),
            asyncio.create_task(self._deliver(connection, down, connection.client, "down")),
        ]
        connection.pumps = pumps
        try:
            done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            if any(not t.cancelled() and t.exception() is not None for t in done):
                connection.abort()
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _receive(self, connection: _Connection, reader: asyncio.StreamReader,
                       pipe: _Pipe, direction: str) -> None:
        loop = asyncio.get_running_loop()
        while data := await reader.read(_READ_BYTES):
            if connection.blackholed:
                self._count_discarded(direction, len(data))
            else:
                await pipe.put(loop.time(), self._latency_s, data)
        await pipe.put(loop.time(), self._latency_s, None)

    async def _deliver(self, connection: _Connection, pipe: _Pipe,
                       writer: asyncio.StreamWriter, direction: str) -> None:
        loop = asyncio.get_running_loop()
        bucket = self._buckets[direction]
        while True:
            due, data = await pipe.get()
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if data is None:
                if not connection.blackholed and writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                return
            if bucket.rate is None:
                # Coalesce what else is already due into one write.
                pieces = [data]
                while pipe.ready(loop.time()):
                    more = (await pipe.get())[1]
                    assert more is not None
                    pieces.append(more)
                if connection.blackholed:
                    self._count_discarded(direction, sum(map(len, pieces)))
                    continue
                writer.writelines(pieces)
                self._count_forwarded(direction, sum(map(len, pieces)))
                await writer.drain()
                continue
            # Under a cap, go out in slices so pacing is smooth at low rates.
            view = memoryview(data)
            step = max(1, int(bucket.burst))
            for start in range(0, len(view), step):
                piece = view[start:start + step]
                wait = 0.0 if connection.blackholed else bucket.take(len(piece), loop.time())
                if wait:
                    await asyncio.sleep(wait)
                if connection.blackholed:  # before or while waiting for tokens
                    self._count_discarded(direction, len(piece))
                    continue
                writer.write(piece)
                self._count_forwarded(direction, len(piece))
                await writer.drain()

    def _count_forwarded(self, direction: str, n: int) -> None:
        if direction == "up":
            self.stats.bytes_up += n
        else:
            self.stats.bytes_down += n

    def _count_discarded(self, direction: str, n: int) -> None:
        if direction == "up":
            self.stats.bytes_discarded_up += n
        else:
            self.stats.bytes_discarded_down += n


class ThreadedProxy:
    """A `FaultProxy` on its own asyncio loop in a daemon thread, for synchronous
    callers; each method returns once the proxy has applied it."""

    def __init__(self, upstream: str | tuple[str, int], *, host: str = "127.0.0.1",
                 port: int = 0, link: LinkSpec | None = None,
                 mirror_ports: tuple[int, ...] = (), timeout_s: float = 10.0) -> None:
        self.proxy = FaultProxy(upstream, host=host, port=port, link=link,
                                mirror_ports=mirror_ports)
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def address(self) -> str:
        return self.proxy.address

    def start(self) -> int:
        """Start the loop thread and listen; returns the port."""
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        upstream = "{}:{}".format(*self.proxy.upstream)
        self._thread = threading.Thread(target=self._run_loop, args=(loop,),
                                        name=f"fault-proxy->{upstream}", daemon=True)
        self._thread.start()
        try:
            return self._submit(self.proxy.start())
        except BaseException:
            self._stop_loop()
            raise

    def stop(self) -> None:
        """Close the listener and every connection, and end the loop thread."""
        if self._thread is None:
            return
        try:
            self._submit(self.proxy.stop())
        finally:
            self._stop_loop()

    def set_latency(self, ms: float) -> None:
        self._apply(lambda: self.proxy.set_latency(ms))

    def set_bandwidth(self, bytes_per_s: float | None) -> None:
        self._apply(lambda: self.proxy.set_bandwidth(bytes_per_s))

    def partition(self) -> None:
        self._apply(self.proxy.partition)

    def heal(self) -> None:
        self._apply(self.proxy.heal)

    def reset_connections(self) -> None:
        self._apply(self.proxy.reset_connections)

    def restore_link(self) -> None:
        self._apply(self.proxy.restore_link)

    def describe(self) -> dict[str, Any]:
        return self._apply(self.proxy.describe)

    def __enter__(self) -> ThreadedProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ------------------------------------------------------------------

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _stop_loop(self) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(self.timeout_s)
        self._thread = None

    def _submit(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop is None or self._thread is None:
            coroutine.close()
            raise RuntimeError("proxy not started")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(self.timeout_s)

    def _apply(self, call: Callable[[], T]) -> T:
        async def on_loop() -> T:
            return call()
        return self._submit(on_loop())


# -- as a process of its own ------------------------------------------------------------

def _command(proxy: FaultProxy, line: str) -> dict[str, Any]:
    """Apply one control line to `proxy`; the answer (its state, or the error)."""
    words = line.split()
    try:
        match words:
            case ["latency", ms]:
                proxy.set_latency(float(ms))
            case ["bandwidth", rate]:
                proxy.set_bandwidth(float(rate) or None)
            case ["partition"]:
                proxy.partition()
            case ["heal"]:
                proxy.heal()
            case ["reset"]:
                proxy.reset_connections()
            case ["restore"]:
                proxy.restore_link()
            case ["describe"]:
                pass
            case _:
                return {"error": f"unknown command {line.strip()!r}; commands: latency MS, "
                                 f"bandwidth BYTES_PER_S (0: no cap), partition, heal, reset, "
                                 f"restore (the link it started with), describe"}
    except ValueError as exc:
        return {"error": str(exc)}
    return proxy.describe()


async def _serve(listen: str, upstream: str, control_listen: str, link: LinkSpec,
                 mirror_ports: tuple[int, ...]) -> None:
    host, port = parse_address(listen)
    proxy = FaultProxy(upstream, host=host, port=port, link=link, mirror_ports=mirror_ports)
    await proxy.start()

    async def on_control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while line := await reader.readline():
                writer.write(json.dumps(_command(proxy, line.decode())).encode() + b"\n")
                await writer.drain()
        writer.close()

    control_host, control_port = parse_address(control_listen)
    server = await asyncio.start_server(on_control, control_host, control_port)
    control_port = server.sockets[0].getsockname()[1]  # the ephemeral one for port 0
    print(f"proxy listening on {proxy.address}, forwarding to {upstream} over a link of "
          f"{link.latency_ms:g} ms one way and {link.bandwidth_bytes_s or 'unlimited'} "
          f"bytes/s; control on {control_host}:{control_port}", flush=True)
    async with server:
        await server.serve_forever()


def control(address: str, command: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Send one command to a `python -m chaos.proxy` control port; its answer.
    Raises `RuntimeError` when it refuses the command, `OSError` when unreachable."""
    host, port = parse_address(address)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(command.encode() + b"\n")
        reply = sock.makefile("rb").readline()
    if not reply:
        raise OSError(f"proxy control {address} closed without answering {command!r}")
    answer: dict[str, Any] = json.loads(reply)
    if "error" in answer:
        raise RuntimeError(f"proxy control {address}: {answer['error']}")
    return answer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m chaos.proxy",
        description="A fault-injecting TCP proxy, switched through a control port.")
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept connections on")
    parser.add_argument("--upstream", required=True, help="HOST:PORT to forward them to")
    parser.add_argument("--control", required=True,
                        help="HOST:PORT of the control port: one command a line (latency MS, "
                             "bandwidth BYTES_PER_S, partition, heal, reset, restore, "
                             "describe), each answered with the proxy's state as one JSON line")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="the link's one-way latency, each direction (default 0)")
    parser.add_argument("--bandwidth-bytes-s", type=float, default=0.0,
                        help="the link's bandwidth cap, each direction, all connections "
                             "together (default 0: no cap); 1 Gbit/s is 125000000")
    parser.add_argument("--mirror-port", type=int, action="append", default=[], metavar="PORT",
                        help="also carry this port of the upstream's host over the link, "
                             "listened on at the same number on the --listen host, which must "
                             "differ from the upstream's (repeatable)")
    args = parser.parse_args(argv)
    try:
        link = LinkSpec(latency_ms=args.latency_ms, bandwidth_bytes_s=args.bandwidth_bytes_s)
        for address in (args.listen, args.upstream, args.control):
            parse_address(address)
        # Refused before anything listens, as the proxy would refuse it.
        FaultProxy(args.upstream, host=parse_address(args.listen)[0],
                   mirror_ports=tuple(args.mirror_port))
    except ValueError as exc:
        parser.error(str(exc))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.listen, args.upstream, args.control, link,
                           tuple(args.mirror_port)))


if __name__ == "__main__":
    main()
