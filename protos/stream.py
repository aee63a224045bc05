"""The one reader of header-plus-chunks streams (`ftsync.proto`'s `Chunk`).

Pushes, pulls and snapshots, replication and peer catch-up over gRPC all send
a header and then the chunks of one flat fp32 vector, in order from offset 0.
`ChunkReader` checks every chunk of such a stream the same way — its kind,
its order, its bounds, its size — and decodes it straight into the caller's
vector, so that the daemon, the learner's client, the peers and the standbys
refuse a bad stream for the same reasons, with the same words. It does no
I/O of its own: the caller hands it a `receive` that awaits the next message
(with whatever idle timeout fits that caller) and maps a `StreamError`'s
`reason` (a `coordinator.errors.Reason` value) to its own refusal.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from protos import ftsync_pb2 as pb
from protos.codec import FP32, MAX_CHUNK_BYTES, Codec, CodecError

Floats = NDArray[np.float32]


class ChunkMessage(Protocol):
    """A push, pull or replica stream message: a oneof of a header and a chunk."""

    @property
    def chunk(self) -> pb.Chunk: ...

    def WhichOneof(self, name: str) -> str | None: ...


class StreamError(ValueError):
    """A chunk stream that breaks the contract; `reason` is the refusal's code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class StreamEnded(StreamError):
    """The stream ended before its vector was complete: cut short, or too short."""

    def __init__(self, message: str) -> None:
        super().__init__("bad_shape", message)


class ChunkReader:
    """Checks and decodes the chunks of one vector of `numel` elements.

    `subject` names the vector in messages ("fragment 3"); chunks come in order
    without gaps, each with at least one element, within the vector, at most
    `MAX_CHUNK_BYTES` of data and exactly the codec's size for its count."""

    def __init__(self, numel: int, subject: str, codec: Codec = FP32,
                 norm: bool = False) -> None:
        """`norm`: also take Σ v² of the decoded (weighted) values, in the decoding
        pass (`square_sum`): the synchronizer's norm check and RDA need it."""
        self.numel = numel
        self.subject = subject
        self.codec = codec
        self.norm = norm
        self.square_sum = 0.0
        self.received = 0  # elements
        self.nbytes = 0  # bytes of chunk data

    @property
    def complete(self) -> bool:
        return self.received == self.numel

    def check(self, offset: int, count: int, nbytes: int) -> None:
        """Refuse a chunk (or bulk frame) out of order, outside the vector, or of the
        wrong size, before any of its data is read."""
        if nbytes > MAX_CHUNK_BYTES:
            raise StreamError("oversize", f"chunk at offset {offset} carries {nbytes} bytes; "
                                          f"the limit is {MAX_CHUNK_BYTES}")
        if offset != self.received:
            raise StreamError("malformed", f"chunk at offset {offset}, expected offset "
                                           f"{self.received} (chunks go in order, without "
                                           f"gaps)")
        if count == 0 or offset + count > self.numel:
            raise StreamError("bad_shape", f"chunk at offset {offset} with {count} elements "
                                           f"does not fit {self.subject} of {self.numel} "
                                           f"elements")
        need = self.codec.encoded_bytes(count)
        if nbytes != need:
            raise StreamError("bad_encoding", f"chunk at offset {offset}: {self.codec.name} "
                                              f"needs {need} bytes for {count} elements, got "
                                              f"{nbytes}")

    def taken(self, count: int, nbytes: int) -> None:
        """A checked chunk's data is in the vector."""
        self.received += count
        self.nbytes += nbytes

    def accept(self, message: ChunkMessage, out: Floats, weight: float = 1.0) -> Floats:
        """Decode one chunk message into its slice of `out` as `weight · values`;
        returns that slice."""
        if message.WhichOneof("kind") != "chunk":
            raise StreamError("malformed", f"the stream of {self.subject} carries one "
                                           f"header, then chunks")
        chunk = message.chunk
        data = chunk.data  # each read of a bytes field copies it: read once
        self.check(chunk.offset, chunk.count, len(data))
        part = out[chunk.offset:chunk.offset + chunk.count]
        self.decode(chunk.offset, data, chunk.scale, part, weight)
        self.taken(chunk.count, len(data))
        return part

    def decode(self, offset: int, data: bytes | memoryview, scale: float, part: Floats,
               weight: float = 1.0) -> None:
        """Decode a checked chunk's data into its slice `part` as `weight · values`,
        with `norm` adding its square sum from the same pass. `data` may be `part`'s
        own memory (an fp32 frame received in place)."""
        try:
            if self.norm:
                self.square_sum += self.codec.decode_norm_into(data, scale, part, weight)
            else:
                self.codec.decode_into(data, scale, part, weight)
        except CodecError as exc:
            raise StreamError("bad_encoding", f"chunk at offset {offset}: {exc}") from exc

    async def read_into(self, receive: Callable[[], Awaitable[ChunkMessage | None]],
                        out: Floats, weight: float = 1.0) -> None:
        """Receive chunks until the vector is complete. `StreamEnded` when `receive`
        answers None (the stream's end) first."""
        while not self.complete:
            message = await receive()
            if message is None:
                raise StreamEnded(f"stream ended after {self.received} of {self.numel} "
                                  f"elements of {self.subject}")
            self.accept(message, out, weight)

    def refuse_more(self, message: ChunkMessage | None) -> None:
        """A message after the last chunk of a stream that carries one vector."""
        if message is not None:
            raise StreamError("bad_shape", f"the stream of {self.subject} goes on after its "
                                           f"{self.numel} elements")
