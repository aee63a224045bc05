"""The bulk channel: a fragment's bytes on a TCP (or TLS) connection of their own.

gRPC carries the control of a transfer — authentication, the header's checks,
refusals, redirects, the acknowledgement — and hands out a single-use ticket
bound to a learner, a fragment and a version; the bytes then move here, at
socket speed (a bare grpcio echo manages a third to a half of a raw socket on
this kind of machine). The daemon serves pushes and pulls this way, a standby
the versions its leader replicates, and a learner its peers' catch-up:
`BulkServer` is the listening side of all of them, `BulkPool` the dialling
side, which keeps idle connections per peer for the next transfer. A call
whose client holds the bytes (a push, a replica) goes through `open_stream`
and `push_announced` on the client and `BulkServer.receive` on the server,
with its fall-back to chunks on the call. `Tickets` issues and redeems
tickets; a transfer's owner (the gRPC call that issued the ticket) receives
the connection through a `Handoff` and gives it back when done. The frames
are sent from the fragment's buffer without copies (`sendall` on a
memoryview) and received with `recv_into` straight into the caller's vector,
checked by `protos.stream.ChunkReader` exactly as gRPC chunks are, and
decoded (weighted) frame by frame.

Wire format (little-endian):

- hello, client to server, once per transfer: the 16-byte ticket, one byte
  n, then the learner id in n bytes of UTF-8;
- answer: one byte, 0 when the ticket is taken; else 1, a u16 length and
  that many bytes of UTF-8 `reason: message`, and the server closes;
- frames, from the side holding the bytes, in order from offset 0 to the
  vector's end: a 28-byte head (u64 offset and u32 count in elements, u32
  data bytes, f32 codec scale, u64 xxh3-64 of the data), then the data;
- after a push's last frame the server answers one byte 0 (every frame taken:
  the connection may carry the next transfer; the acknowledgement itself
  comes on the gRPC call).

The checksum is xxh3-64 rather than CRC32C: measured on this machine (AMD
EPYC) at 14-44 GB/s against google-crc32c's 16 GB/s, and it hashes a
memoryview of the staging buffer, where google-crc32c's binding takes only
read-only bytes, a copy of every frame.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import numpy as np
import xxhash
from numpy.typing import NDArray

from protos import metadata
from protos.codec import FP32, MAX_CHUNK_BYTES, Codec, chunk_elements
from protos.stream import ChunkMessage, ChunkReader, StreamError
from protos.tls import TlsMaterial, client_context

Floats = NDArray[np.float32]
T = TypeVar("T")
M = TypeVar("M")
C = TypeVar("C")

TICKET_BYTES: Final = 16
HEAD: Final = struct.Struct("<QIIfQ")
# Data per frame: the largest gRPC chunk, so both paths check frames alike.
FRAME_BYTES: Final = MAX_CHUNK_BYTES
_TAKEN: Final = b"\x00"
_REFUSED: Final = 1
_LITTLE: Final = sys.byteorder == "little"


def bulk_host(address: str) -> str:
    """The host of `HOST:PORT` (or `[v6]:PORT`), where the bulk port is too."""
    return address.rpartition(":")[0].strip("[]")


def checksum(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class BulkError(StreamError):
    """A bulk transfer refused or broken; `reason` is the refusal's code
    (`bad_ticket`, `corrupt`, or one of `protos.stream`'s)."""


class BulkCut(Exception):
    """A transfer's connection never came (`idle`) or broke before its last frame
    (`cut`): not refused, the sender sends it again."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class BulkUnreachable(OSError):
    """The bulk port could not be dialled (refused, filtered, no route): the same
    bytes go as gRPC chunks instead."""


# -- tickets ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """What a ticket lets its bearer move: one learner's fragment at one version
    (learner_id "" for any learner, as a peer serving catch-up grants)."""

    learner_id: str
    fragment: int
    version: int


class Handoff:
    """A ticket's connection on its way from the bulk port to the call that issued
    the ticket, and back: `release(True)` lets it carry another transfer."""

    def __init__(self, grant: Grant) -> None:
        loop = asyncio.get_running_loop()
        self.grant = grant
        self.connection: asyncio.Future[socket.socket] = loop.create_future()
        self.released: asyncio.Future[bool] = loop.create_future()

    def release(self, reusable: bool) -> None:
        if not self.released.done():
            self.released.set_result(reusable)

    def close(self) -> None:
        """The owner is done: a connection that arrives later is refused, one that
        arrived and was not released is closed."""
        if not self.connection.done():
            self.connection.cancel()
        self.release(False)


class Tickets:
    """Single-use tickets: issued by a control call, redeemed once by a bulk
    connection before `ttl_s` passes. No I/O; the clock is passed in."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._open: dict[bytes, tuple[Handoff, float]] = {}
        # Redeemed or withdrawn, remembered until they would have expired: a second
        # use is told "spent", not "unknown".
        self._spent: dict[bytes, float] = {}

    def issue(self, handoff: Handoff) -> bytes:
        self._expire()
        ticket = secrets.token_bytes(TICKET_BYTES)
        self._open[ticket] = (handoff, self.clock() + self.ttl_s)
        return ticket

    def withdraw(self, ticket: bytes) -> None:
        """The call that issued it is done with it, used or not."""
        entry = self._open.pop(ticket, None)
        if entry is not None:
            self._spent[ticket] = entry[1]

    def redeem(self, ticket: bytes, learner_id: str,
               names: frozenset[str] | None = None) -> Handoff:
        """The handoff of a live ticket presented by `learner_id` (whose verified
        certificate names are `names`, under mutual TLS); `BulkError` otherwise."""
        entry = self._open.get(ticket)
        if entry is None:
            spent = ticket in self._spent
            self._expire()
            raise BulkError("bad_ticket", "the ticket is spent (each is good for one "
                                          "transfer)" if spent else "no such ticket")
        handoff, expires_at = entry
        if expires_at < self.clock():
            self.withdraw(ticket)
            raise BulkError("bad_ticket", f"the ticket expired (tickets last {self.ttl_s:g} s)")
        grant = handoff.grant
        if grant.learner_id and learner_id != grant.learner_id:
            raise BulkError("bad_ticket", f"the ticket is learner {grant.learner_id!r}'s, "
                                          f"presented by {learner_id!r}")
        if grant.learner_id and names is not None and learner_id not in names:
            raise BulkError("bad_ticket", f"the client certificate is issued to "
                                          f"{', '.join(sorted(names))}, not to learner "
                                          f"{learner_id!r}")
        if handoff.connection.done():  # its call ended while the connection arrived
            self.withdraw(ticket)
            raise BulkError("bad_ticket", "the transfer this ticket was for has ended")
        self.withdraw(ticket)
        return handoff

    def _expire(self) -> None:
        now = self.clock()
        for ticket in [t for t, (_, at) in self._open.items() if at < now]:
            self.withdraw(ticket)
        for ticket in [t for t, at in self._spent.items() if at < now]:
            del self._spent[ticket]


# -- frames -----------------------------------------------------------------------------


def send_frames(conn: socket.socket, values: Floats, codec: Codec = FP32,
                frame_bytes: int = FRAME_BYTES, start: int = 0) -> int:
    """Blocking: `values` as frames, fp32 straight from the array's memory; returns
    the data bytes sent. `start`: the offset of `values` in the vector transferred
    (a replica's momentum follows its parameters)."""
    step = chunk_elements(codec, frame_bytes)
    vector = np.ascontiguousarray(values, dtype="<f4")
    sent = 0
    for offset in range(0, vector.size, step):
        part = vector[offset:offset + step]
        if codec is FP32:
            data: memoryview | bytes = part.data.cast("B")
            scale = 1.0
        else:
            data, scale = codec.encode(part)
        nbytes = memoryview(data).nbytes
        conn.sendall(HEAD.pack(start + offset, part.size, nbytes, scale, checksum(data)))
        conn.sendall(data)
        sent += nbytes
    return sent


def receive_frames(conn: socket.socket, reader: ChunkReader, out: Floats,
                   weight: float = 1.0) -> None:
    """Blocking: frames into `out` as `weight · values` until `reader` is complete.
    fp32 frames land straight in `out`; a frame is checked against its checksum
    before it is weighted or decoded, in one pass with its norm when the reader
    takes it (`ChunkReader.decode`)."""
    codec = reader.codec
    direct = codec is FP32 and _LITTLE
    scratch = None if direct else memoryview(bytearray(FRAME_BYTES))
    while not reader.complete:
        offset, count, nbytes, scale, digest = HEAD.unpack(_recv_exactly(conn, HEAD.size))
        reader.check(offset, count, nbytes)
        part = out[offset:offset + count]
        target = part.data.cast("B") if scratch is None else scratch[:nbytes]
        _recv_into(conn, target)
        if checksum(target) != digest:
            raise BulkError("corrupt", f"frame at offset {offset} of {reader.subject} fails "
                                       f"its checksum")
        if scratch is not None:
            reader.decode(offset, target, scale, part, weight)
        elif weight != 1.0 or reader.norm:
            reader.decode(offset, target, 1.0, part, weight)  # in place
        reader.taken(count, nbytes)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buffer = bytearray(n)
    _recv_into(conn, memoryview(buffer))
    return bytes(buffer)


def _recv_into(conn: socket.socket, view: memoryview) -> None:
    # MSG_WAITALL: one call for the lot; an SSL socket takes no flags.
    wait_all = 0 if isinstance(conn, ssl.SSLSocket) else socket.MSG_WAITALL
    got = 0
    while got < view.nbytes:
        n = conn.recv_into(view[got:], view.nbytes - got, wait_all)
        if n == 0:
            raise ConnectionError(f"the connection closed after {got} of {view.nbytes} "
                                  f"bytes")
        got += n


def kernel_timeouts(conn: socket.socket, seconds: float) -> None:
    """Make `conn` blocking, with sends and receives that fail after `seconds` without
    progress: the kernel's timeouts, where Python's own would poll before each call."""
    conn.settimeout(None)
    timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


def _cert_names(conn: socket.socket) -> frozenset[str] | None:
    """The names of a TLS client's verified certificate; None without one."""
    if not isinstance(conn, ssl.SSLSocket):
        return None
    cert: Any = conn.getpeercert()
    if not cert:
        return None
    names = [str(value) for rdn in cert.get("subject", ()) for key, value in rdn
             if key == "commonName"]
    names += [str(value) for _, value in cert.get("subjectAltName", ())]
    return frozenset(names)


# -- the listening side -----------------------------------------------------------------


class BulkServer:
    """A bulk port: takes connections, redeems each transfer's ticket and hands the
    connection to the call that issued it; `refused(reason, learner_id, message)`
    counts every refusal. Blocking socket work runs in worker threads, where the
    kernel waits with the GIL released."""

    def __init__(self, tickets: Tickets, tls: ssl.SSLContext | None,
                 refused: Callable[[str, str, str], None], *, idle_s: float = 30.0,
                 workers: int = 32, initializer: Callable[[], None] | None = None) -> None:
        self.tickets = tickets
        self.tls = tls
        self.refused = refused
        self.idle_s = idle_s
        self.port = 0
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Open connections, each shut down at stop: a worker thread blocked reading
        # one would otherwise hold the process's exit until its idle timeout.
        self._open: set[socket.socket] = set()
        self._threads = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="ftsync-bulk", initializer=initializer)

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on `port` of `host` (0: a free one); returns the port."""
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(sockaddr)
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._spawn(self._accept())
        return self.port

    async def stop(self) -> None:
        for conn in list(self._open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def run(self, conn: socket.socket, work: Callable[[], T]) -> T:
        """Run blocking `work` on `conn` in a worker thread. If the caller is cancelled
        meanwhile, the connection is shut down (waking the thread) and the thread is
        waited for: it must not write into a buffer the caller hands on."""
        future = asyncio.get_running_loop().run_in_executor(self._threads, work)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            await asyncio.wait([future])
            raise

    async def receive(self, grant: Grant, announce: Callable[[bytes, int], Awaitable[None]],
                      stream: AsyncIterator[ChunkMessage],
                      receive: Callable[[], Awaitable[ChunkMessage | None]],
                      reader: ChunkReader, out: Floats, weight: float, idle_s: float) -> str:
        """The receiving end of a call whose client holds the bytes (a push, a
        replica): a ticket bound to `grant` goes out through `announce(ticket, port)`,
        then the frames its connection brings land in `out` as `weight · values`; or,
        when the client sends the chunks on the call instead (it cannot reach this
        port), those, read through `receive`. Returns the transport the bytes took,
        "bulk" or "grpc_fallback". `BulkCut` when no connection comes within `idle_s`
        or it breaks before the last frame; `StreamError` for a bad frame or chunk."""
        handoff = Handoff(grant)
        ticket = self.tickets.issue(handoff)
        # The call's next message: a chunk if the client falls back, else its end.
        fallback = asyncio.ensure_future(anext(stream, None))
        try:
            await announce(ticket, self.port)
            await asyncio.wait((handoff.connection, fallback), timeout=idle_s,
                               return_when=asyncio.FIRST_COMPLETED)
            if not handoff.connection.done() and fallback.done():
                first = fallback.result()
                if first is not None:
                    self.tickets.withdraw(ticket)
                    reader.accept(first, out, weight)
                    await reader.read_into(receive, out, weight)
                    reader.refuse_more(await receive())
                    return "grpc_fallback"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(handoff.connection), idle_s)
            if not handoff.connection.done():
                raise BulkCut("idle", f"opened no bulk connection within {idle_s:g} s")
            conn = handoff.connection.result()
            reusable = False
            try:
                await self.run(conn, lambda: receive_frames(conn, reader, out, weight))
                await self.run(conn, lambda: taken(conn))
                reusable = True
            except (OSError, ConnectionError) as exc:
                raise BulkCut("cut", f"its bulk connection broke after {reader.received} of "
                                     f"{reader.numel} elements ({exc})") from None
            finally:
                handoff.release(reusable)
            # The client ends the call's stream once its frames are taken.
            async with asyncio.timeout(idle_s):
                reader.refuse_more(await fallback)
            return "bulk"
        finally:
            self.tickets.withdraw(ticket)
            handoff.close()
            if not fallback.done():
                fallback.cancel()

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            self._spawn(self._serve(conn))

    async def _serve(self, raw: socket.socket) -> None:
        """One connection: transfer after transfer, each opened by its hello."""
        loop = asyncio.get_running_loop()
        kernel_timeouts(raw, self.idle_s)
        conn = raw  # wrapping for TLS detaches `raw`: from then on, `conn` is the socket
        self._open.add(raw)
        try:
            if self.tls is not None:
                context = self.tls
                conn = await loop.run_in_executor(
                    self._threads, lambda: context.wrap_socket(raw, server_side=True))
                self._open.discard(raw)
                self._open.add(conn)
            names = _cert_names(conn)
            transfers = 0
            while True:
                try:
                    ticket, learner_id = await loop.run_in_executor(self._threads,
                                                                    _read_hello, conn)
                except (OSError, ConnectionError, ValueError) as exc:
                    if not transfers:  # a pooled connection may end between transfers
                        self.refused("bad_ticket", "", f"the connection sent no ticket "
                                                       f"({exc})")
                    return
                transfers += 1
                try:
                    handoff = self.tickets.redeem(ticket, learner_id, names)
                except BulkError as refusal:
                    self.refused(refusal.reason, learner_id, refusal.message)
                    answer = f"{refusal.reason}: {refusal.message}".encode()
                    await loop.run_in_executor(self._threads, conn.sendall, struct.pack(
                        "<BH", _REFUSED, len(answer)) + answer)
                    return
                await loop.run_in_executor(self._threads, conn.sendall, _TAKEN)
                if handoff.connection.done():  # its owner gave up meanwhile
                    return
                handoff.connection.set_result(conn)
                if not await handoff.released:
                    return
        except (OSError, ConnectionError, ValueError, ssl.SSLError):
            pass  # the client went away, timed out, or never spoke the protocol
        finally:
            self._open.discard(raw)
            self._open.discard(conn)
            conn.close()


def _read_hello(conn: socket.socket) -> tuple[bytes, str]:
    head = _recv_exactly(conn, TICKET_BYTES + 1)
    learner_id = _recv_exactly(conn, head[-1]).decode() if head[-1] else ""
    return head[:TICKET_BYTES], learner_id


def taken(conn: socket.socket) -> None:
    """The push receiver's word that every frame arrived (`BulkPool.push` waits for it)."""
    conn.sendall(_TAKEN)


# -- the dialling side ------------------------------------------------------------------


class Abort:
    """Ends one transfer from another thread: `cut` shuts its connection down, waking
    the worker blocked on it (a partitioned peer never answers, and its sends would
    wait out the kernel's timeout), and a transfer not yet connected fails at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self.cut_off = False

    def cut(self) -> None:
        with self._lock:
            self.cut_off = True
            if self._conn is not None:
                with contextlib.suppress(OSError):
                    self._conn.shutdown(socket.SHUT_RDWR)

    def running(self, conn: socket.socket | None) -> None:
        """The transfer's connection from now on (None: done with it, pooled)."""
        with self._lock:
            if conn is not None and self.cut_off:
                raise ConnectionError("the transfer was abandoned")
            self._conn = conn


class BulkPool:
    """Bulk connections, kept per (host, port) after a clean transfer for the next one.
    Blocking: call from worker threads. TLS with `tls` (the server's name checked
    against the host dialled)."""

    def __init__(self, learner_id: str, tls: TlsMaterial | None = None,
                 timeout_s: float = 30.0) -> None:
        self.learner_id = learner_id
        self.timeout_s = timeout_s
        self._tls = client_context(tls) if tls is not None else None
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()

    def push(self, host: str, port: int, ticket: bytes, values: Floats | Sequence[Floats],
             codec: Codec, abort: Abort | None = None) -> int:
        """Send `values` (or several vectors, one after the other as one) under
        `ticket`; returns the data bytes sent. `abort` can end it from another thread."""
        parts = [values] if isinstance(values, np.ndarray) else list(values)

        def work(conn: socket.socket) -> int:
            sent = start = 0
            for part in parts:
                sent += send_frames(conn, part, codec, start=start)
                start += part.size
            if _recv_exactly(conn, 1) != _TAKEN:
                raise ConnectionError("the bulk port did not take every frame")
            return sent
        return self._transfer(host, port, ticket, work, abort or Abort())

    def pull(self, host: str, port: int, ticket: bytes, reader: ChunkReader,
             out: Floats) -> None:
        """Receive the vector `reader` describes into `out` under `ticket`."""
        def work(conn: socket.socket) -> None:
            receive_frames(conn, reader, out)
        self._transfer(host, port, ticket, work, Abort())

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def _transfer(self, host: str, port: int, ticket: bytes,
                  work: Callable[[socket.socket], T], abort: Abort) -> T:
        hello = ticket + bytes([len(self.learner_id.encode())]) + self.learner_id.encode()
        while True:
            conn, pooled = self._take(host, port)
            try:
                abort.running(conn)
                try:
                    conn.sendall(hello)
                    status = conn.recv(1)
                except OSError:
                    if not pooled:
                        raise
                    status = b""
                if not status and pooled:
                    conn.close()  # the server closed it while it was idle: dial afresh
                    continue
                if status != _TAKEN:
                    raise _refusal(conn, status)
                result = work(conn)
                abort.running(None)
            except BaseException as exc:
                abort.running(None)
                conn.close()
                if abort.cut_off and isinstance(exc, Exception):
                    # Whatever the shut-down socket made of it: abandoned, not refused.
                    raise ConnectionError("the transfer was abandoned") from exc
                raise
            with self._lock:
                self._idle.setdefault((host, port), []).append(conn)
            return result

    def _take(self, host: str, port: int) -> tuple[socket.socket, bool]:
        with self._lock:
            idle = self._idle.get((host, port))
            if idle:
                return idle.pop(), True
        try:
            raw = socket.create_connection((host, port), timeout=self.timeout_s)
        except OSError as exc:
            raise BulkUnreachable(exc.errno, f"bulk port {host}:{port}: {exc}") from exc
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kernel_timeouts(raw, self.timeout_s)
        if self._tls is None:
            return raw, False
        try:
            return self._tls.wrap_socket(raw, server_hostname=host), False
        except BaseException:
            raw.close()
            raise


def _refusal(conn: socket.socket, status: bytes) -> BulkError:
    if status != bytes([_REFUSED]):
        return BulkError("malformed", f"the bulk port answered {status!r}")
    (length,) = struct.unpack("<H", _recv_exactly(conn, 2))
    reason, _, message = _recv_exactly(conn, length).decode().partition(": ")
    return BulkError(reason, message)


# -- a client-streaming call that carries its bytes on the bulk channel ---------------


async def push_announced(pool: BulkPool, call: Any, host: str,
                         values: Floats | Sequence[Floats], codec: Codec,
                         unreachable: Callable[[BulkUnreachable], None]) -> str:
    """The client's end of `BulkServer.receive`: the frames on the bulk connection
    the call's initial metadata names. Returns "grpc" when the chunks are to follow
    on the call instead (a server without a bulk port, one whose port cannot be
    reached — `unreachable` is told why — or a refused ticket), else "bulk": the
    frames went, or the call was refused before any ticket, or the connection was
    cut, and the call's status says why."""
    initial = {key: value for key, value in await call.initial_metadata() or ()}
    ticket, port = initial.get(metadata.BULK_TICKET), initial.get(metadata.BULK_PORT)
    if port == "0":
        return "grpc"
    if not ticket or not port:
        return "bulk"
    # A call that ends first (its replica left behind, cut off) takes its transfer
    # with it: the worker would otherwise wait on a peer that may never answer.
    abort = Abort()
    call.add_done_callback(lambda _: abort.cut())
    try:
        await asyncio.to_thread(pool.push, host, int(port), bytes.fromhex(str(ticket)),
                                values, codec, abort)
    except BulkUnreachable as exc:
        unreachable(exc)
        return "grpc"
    except BulkError as exc:
        if exc.reason != "bad_ticket":
            raise
        return "grpc"  # the call still waits for the chunks: they go there
    except (OSError, ConnectionError):
        pass  # cut: the call's status says why (cut, corrupt), and it is sent again
    return "bulk"


async def open_stream(start: Callable[[AsyncIterator[M]], C], header: M,
                      chunks: Callable[[], Iterable[M]],
                      bulk: Callable[[C], Awaitable[str]] | None) -> C:
    """Start a client-streaming call with `header`; its chunks follow on the call,
    or, with `bulk`, go on the bulk channel `bulk(call)` moves them on, unless it
    answers "grpc". Returns the call, to await for its answer."""
    took: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    if bulk is None:
        took.set_result("grpc")

    async def messages() -> AsyncIterator[M]:
        yield header
        # Shielded: a cancelled call cancels this generator's task, not the decision.
        if await asyncio.shield(took) == "grpc":
            for message in chunks():
                yield message

    call = start(messages())
    try:
        if bulk is not None:
            took.set_result(await bulk(call))
    finally:
        if not took.done():  # the bulk transfer failed or was cancelled
            took.set_result("bulk")
    return call
