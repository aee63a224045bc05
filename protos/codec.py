"""Tensor codec: fp32 vectors to and from the chunk bytes of `ftsync.proto`.

Learners call `iter_chunks` to encode outer gradients and parameters for a push; the
synchronizer calls `decode_chunk_into` to fold each chunk, weighted, into its fp32
accumulator, and both sides use the same pair for pulls and snapshots. Bytes travel raw
little-endian with nothing per element in protobuf, and every step is vectorised numpy,
because 100M-element fragments pass through here on every round.

Error bounds per element, for input x, decoded y and m = max|x| over the chunk:

- fp32: exact.
- bf16: round to nearest even, |y - x| <= 2^-8 |x| for normal x; NaN and ±Inf survive, and
  finite x beyond the bf16 range rounds to ±Inf as IEEE rounding does.
- int8: scale s = m / 127, q = round(x / s) in [-127, 127], |y - x| <= s / 2.
- e3m0: scale m; |x| is rounded to the nearest power of two in log2 space, so a non-zero y
  has the sign of x and |y - x| <= (√2 - 1) |x|. y is zero only when |x| < 2^-6.5 m, so
  below 2^-6 m the absolute error is at most 2^-6.5 m.

All bounds hold up to fp32 rounding. A chunk of int8 or e3m0 holding NaN or Inf has m NaN or
+Inf, so it is sent as all-zero codes with a NaN or +Inf scale, and a non-finite scale decodes
to NaN across the chunk: the synchronizer's finiteness check then rejects it as not finite,
rather than the codec hiding the values or inventing its own reason.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterator
from typing import Final, TypeVar

import numpy as np
from numpy.typing import NDArray

from protos import ftsync_pb2

_MIB: Final = 1 << 20
DEFAULT_CHUNK_BYTES: Final = 2 * _MIB
MIN_CHUNK_BYTES: Final = 1 * _MIB
MAX_CHUNK_BYTES: Final = 4 * _MIB
# gRPC's message-size limits on every channel and server that carries chunks. They sit
# above ours, so an oversize chunk between the two gets our error (named and counted),
# not gRPC's. Spread them into a channel's or server's options.
MESSAGE_SIZE_OPTIONS: Final = (("grpc.max_receive_message_length", 2 * MAX_CHUNK_BYTES),
                               ("grpc.max_send_message_length", 2 * MAX_CHUNK_BYTES))

# Encoders and the two-pass decoders walk a vector in blocks of this many elements (512 KiB
# of fp32), so temporaries stay in cache and page faults on fresh buffers stay rare. Even,
# so e3m0 blocks hold whole bytes.
_BLOCK: Final = 1 << 17

Floats = NDArray[np.float32]


class CodecError(ValueError):
    """Bad codec input: byte count, scale, codec value, chunk range or chunk size."""


class Codec(abc.ABC):
    """One wire encoding of fp32 values; the four instances are stateless."""

    wire: ftsync_pb2.Codec
    name: str
    bits: int
    # Whether the chunk's scale is part of the encoding; fp32 and bf16 ignore it, since
    # proto3 delivers 0.0 when a sender leaves it unset.
    scaled: bool

    def encoded_bytes(self, count: int) -> int:
        return (count * self.bits + 7) // 8

    def encode(self, values: Floats) -> tuple[bytes, float]:
        """Encode a 1-D float32 vector; returns the chunk data and its scale (1.0 if unscaled)."""
        return self._encode(_as_vector(values))

    def decode_into(
        self, data: bytes | memoryview, scale: float, out: Floats, weight: float = 1.0
    ) -> None:
        """Write `weight * decoded` into `out`, a contiguous float32 vector of the chunk's count.

        Overflow and NaN arithmetic stay quiet: the synchronizer checks finiteness itself and
        names the reason, and a warning per chunk would only be noise.
        """
        if self._checked(data, scale, out):
            with np.errstate(over="ignore", invalid="ignore"):
                self._decode_into(data, scale, out, weight)

    def decode_norm_into(
        self, data: bytes | memoryview, scale: float, out: Floats, weight: float = 1.0
    ) -> float:
        """`decode_into`, returning Σ out² (`norm_sq`) from the same pass.

        The synchronizer needs every contribution's norm: squaring each cache-sized block
        right after it is decoded reads it from cache, where a pass over the whole chunk
        afterwards reads it back from memory on a machine whose cache holds less than a
        chunk. `data` may be `out`'s own memory (an fp32 frame received in place): each
        element is read before it is written."""
        if not self._checked(data, scale, out):
            return math.nan
        view = memoryview(data).cast("B")
        total = 0.0
        with np.errstate(over="ignore", invalid="ignore"):
            for start in range(0, out.shape[0], _BLOCK):
                block = out[start : start + _BLOCK]
                first = self.encoded_bytes(start)
                self._decode_into(view[first : first + self.encoded_bytes(block.shape[0])],
                                  scale, block, weight)
                total += norm_sq(block)
        return total

    def _checked(self, data: bytes | memoryview, scale: float, out: Floats) -> bool:
        """Refuse a wrong byte count or scale; False (`out` filled with NaN) for a
        non-finite scale, which leaves nothing to decode."""
        if out.dtype != np.float32 or out.ndim != 1 or not out.flags.c_contiguous:
            raise CodecError(
                f"out must be a contiguous 1-D float32 array, got {out.dtype} of shape {out.shape}"
            )
        count = out.shape[0]
        need = self.encoded_bytes(count)
        got = memoryview(data).nbytes
        if got != need:
            raise CodecError(f"{self.name} needs {need} bytes for {count} elements, got {got}")
        if self.scaled:
            if scale < 0:
                raise CodecError(f"{self.name} scale must be >= 0, got {scale}")
            if not math.isfinite(scale):
                out.fill(math.nan)
                return False
        return True

    @abc.abstractmethod
    def _encode(self, values: Floats) -> tuple[bytes, float]: ...

    @abc.abstractmethod
    def _decode_into(
        self, data: bytes | memoryview, scale: float, out: Floats, weight: float
    ) -> None: ...


class _Fp32(Codec):
    wire = ftsync_pb2.CODEC_FP32
    name = "fp32"
    bits = 32
    scaled = False

    def _encode(self, values: Floats) -> tuple[bytes, float]:
        return values.astype("<f4", copy=False).tobytes(), 1.0

    def _decode_into(
        self, data: bytes | memoryview, scale: float, out: Floats, weight: float
    ) -> None:
        np.multiply(np.frombuffer(data, "<f4"), weight, out=out)


class _Bf16(Codec):
    wire = ftsync_pb2.CODEC_BF16
    name = "bf16"
    bits = 16
    scaled = False

    def _encode(self, values: Floats) -> tuple[bytes, float]:
        return _blockwise(values, _bf16_block), 1.0

    def _decode_into(
        self, data: bytes | memoryview, scale: float, out: Floats, weight: float
    ) -> None:
        half = np.frombuffer(data, "<u2")
        for start in range(0, out.shape[0], _BLOCK):
            block = out[start : start + _BLOCK]
            widened = block.view(np.uint32)
            np.left_shift(half[start : start + _BLOCK], 16, out=widened, dtype=np.uint32)
            if weight != 1.0:
                np.multiply(block, weight, out=block)


def _bf16_block(values: Floats) -> bytes:
    bits = values.view(np.uint32)
    # Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop 16 bits.
    rounded = bits >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    half = rounded.astype("<u2")
    if np.isnan(values.max()):
        # The carry can turn a NaN into Inf or wrap it to zero; send a quiet NaN instead.
        nan = np.isnan(values)
        half[nan] = (bits[nan] >> 16) | 0x0040
    return half.tobytes()


class _Int8(Codec):
    wire = ftsync_pb2.CODEC_INT8
    name = "int8"
    bits = 8
    scaled = True

    def _encode(self, values: Floats) -> tuple[bytes, float]:
        scale = np.float32(_absmax(values)) / np.float32(127)
        if not (scale > 0 and math.isfinite(scale)):
            return bytes(values.shape[0]), float(scale)
        return _blockwise(values, lambda block: _int8_block(block, scale)), float(scale)

    def _decode_into(
        self, data: bytes | memoryview, scale: float, out: Floats, weight: float
    ) -> None:
        np.multiply(np.frombuffer(data, np.int8), np.float32(scale * weight), out=out)


def _int8_block(values: Floats, scale: np.float32) -> bytes:
    q = np.divide(values, scale)
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    return q.astype(np.int8).tobytes()


def _e3m0_values() -> NDArray[np.float64]:
    """The 16 nibble values for scale 1: bit 3 the sign, bits 0-2 the exponent e."""
    e = np.arange(16) & 7
    magnitude = np.where(e > 0, np.exp2(e - 7.0), 0.0)
    return np.where(np.arange(16) & 8, -magnitude, magnitude)


# Byte b decodes to the pair (low nibble, high nibble), element order on the wire.
_E3M0_PAIRS: Final = _e3m0_values()[np.stack([np.arange(256) & 15, np.arange(256) >> 4], 1)]
# Added to the bits of r in [2^-7, 1], this carries into the exponent field exactly when
# r's mantissa is >= √2 (rounding log2 r to nearest) and maps biased exponent 120 (2^-7) to
# 0, so the field becomes e.
_E3M0_ROUND: Final = (0x800000 - 0x3504F4) - (120 << 23)


class _E3m0(Codec):
    wire = ftsync_pb2.CODEC_E3M0
    name = "e3m0"
    bits = 4
    scaled = True

    def _encode(self, values: Floats) -> tuple[bytes, float]:
        scale = _absmax(values)
        if not (scale > 0 and math.isfinite(scale)):
            return bytes(self.encoded_bytes(values.shape[0])), scale
        return _blockwise(values, lambda block: _e3m0_block(block, np.float32(scale))), scale

    def _decode_into(
        self, data: bytes | memoryview, scale: float, out: Floats, weight: float
    ) -> None:
        table = (_E3M0_PAIRS * (scale * weight)).astype(np.float32)
        packed = np.frombuffer(data, np.uint8)
        count = out.shape[0]
        whole = count // 2
        pairs = out[: 2 * whole].reshape(whole, 2)
        # np.take widens each block's indices to intp; blocks keep that buffer in cache.
        # A byte is always a row of the table, and mode="clip" says so: the default
        # ("raise") buffers `out` and copies it back, which made this 8x slower.
        for start in range(0, whole, _BLOCK // 2):
            stop = min(start + _BLOCK // 2, whole)
            np.take(table, packed[start:stop], axis=0, out=pairs[start:stop], mode="clip")
        if count & 1:
            out[-1] = table[packed[-1], 0]


def _e3m0_block(values: Floats, scale: np.float32) -> bytes:
    count = values.shape[0]
    ratio = np.divide(values, scale)
    bits = ratio.view(np.int32)
    sign = bits >> 28
    sign &= 8
    bits &= 0x7FFFFFFF
    # Everything under 2^-7 encodes as zero just like [2^-7, 2^-6.5) does, and the clamp
    # keeps the subtraction in _E3M0_ROUND from going negative.
    np.maximum(ratio, 2.0**-7, out=ratio)
    bits += _E3M0_ROUND
    bits >>= 23
    bits |= sign
    codes = np.zeros(count + (count & 1), np.uint8)
    codes[:count] = bits
    # As little-endian pairs the second code sits at bit 8; shifted to bit 4 it joins the
    # first, which is under 16 and so shifts out.
    pairs = codes.view("<u2")
    packed = pairs >> 4
    packed |= pairs
    return packed.astype(np.uint8).tobytes()


FP32: Final[Codec] = _Fp32()
BF16: Final[Codec] = _Bf16()
INT8: Final[Codec] = _Int8()
E3M0: Final[Codec] = _E3m0()
CODECS: Final[tuple[Codec, ...]] = (FP32, BF16, INT8, E3M0)
_BY_WIRE: Final = {int(codec.wire): codec for codec in CODECS}
_BY_NAME: Final = {codec.name: codec for codec in CODECS}


def codec_for(wire: int) -> Codec:
    """The codec for a `Codec` enum value off the wire."""
    try:
        return _BY_WIRE[wire]
    except KeyError:
        raise CodecError(f"unknown codec value {wire}") from None


def codec_named(name: str) -> Codec:
    """The codec for a configuration or CLI name."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; valid: {', '.join(_BY_NAME)}") from None


def chunk_elements(codec: Codec, chunk_bytes: int) -> int:
    """Elements per chunk so that its data fits in `chunk_bytes` (even for e3m0)."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise CodecError(
            f"chunk_bytes {chunk_bytes} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]"
        )
    return chunk_bytes * 8 // codec.bits


def iter_chunks(
    values: Floats, codec: Codec, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[ftsync_pb2.Chunk]:
    """Encode a 1-D float32 vector as consecutive chunks; validates before the first chunk."""
    step = chunk_elements(codec, chunk_bytes)
    return _chunks(_as_vector(values), codec, step)


def _chunks(values: Floats, codec: Codec, step: int) -> Iterator[ftsync_pb2.Chunk]:
    for offset, count, scale, data in _encoded(values, codec, step):
        yield ftsync_pb2.Chunk(offset=offset, count=count, scale=scale, data=data)


StreamMessage = TypeVar("StreamMessage", ftsync_pb2.PushMessage, ftsync_pb2.PullMessage,
                        ftsync_pb2.ReplicaMessage)


def iter_chunk_messages(
    values: Floats,
    codec: Codec,
    message_type: type[StreamMessage],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[StreamMessage]:
    """Chunks already inside push or pull stream messages, filled in place.

    Wrapping a built `Chunk` (`PushMessage(chunk=c)`) costs upb a serialise and a parse
    of the whole chunk; filling the fields of the message's own chunk costs one copy."""
    step = chunk_elements(codec, chunk_bytes)
    vector = _as_vector(values)

    def messages() -> Iterator[StreamMessage]:
        for offset, count, scale, data in _encoded(vector, codec, step):
            yield chunk_message(message_type, offset, count, scale, data)

    return messages()


def chunk_message(message_type: type[StreamMessage], offset: int, count: int, scale: float,
                  data: bytes) -> StreamMessage:
    """One encoded chunk inside a stream message, its fields filled in place (see
    `iter_chunk_messages`)."""
    message = message_type()
    chunk = message.chunk
    chunk.offset = offset
    chunk.count = count
    chunk.scale = scale
    chunk.data = data
    return message


def _encoded(values: Floats, codec: Codec, step: int) -> Iterator[tuple[int, int, float, bytes]]:
    for offset in range(0, values.shape[0], step):
        part = values[offset : offset + step]
        data, scale = codec.encode(part)
        yield offset, part.shape[0], scale, data


def decode_chunk_into(
    chunk: ftsync_pb2.Chunk, codec: Codec, out_full: Floats, weight: float = 1.0
) -> None:
    """Write `weight * decoded` into the chunk's slice of the fragment vector `out_full`."""
    numel = out_full.shape[0]
    end = chunk.offset + chunk.count
    if end > numel:
        raise CodecError(
            f"chunk at offset {chunk.offset} with count {chunk.count} exceeds numel {numel}"
        )
    try:
        codec.decode_into(chunk.data, chunk.scale, out_full[chunk.offset : end], weight)
    except CodecError as e:
        raise CodecError(f"chunk at offset {chunk.offset}: {e}") from None


def _as_vector(values: Floats) -> Floats:
    if values.dtype != np.float32 or values.ndim != 1:
        raise CodecError(
            f"values must be a 1-D float32 array, got {values.dtype} of shape {values.shape}"
        )
    return np.ascontiguousarray(values)


def _blockwise(values: Floats, encode_block: Callable[[Floats], bytes]) -> bytes:
    """Encode cache-sized blocks, so only the joined result is a full-size allocation."""
    blocks = range(0, values.shape[0], _BLOCK)
    return b"".join([encode_block(values[start : start + _BLOCK]) for start in blocks])


def add_delta(reference: Floats, decoded: Floats, out: Floats | None = None) -> Floats:
    """A reference plus a decoded delta, as a new vector (or into `out`): one fp32
    addition, the same in the coordinator and in every learner that pulls deltas, so
    their copies agree bit for bit."""
    return np.add(reference, decoded, out=out, dtype=np.float32)


def norm_sq(values: Floats) -> float:
    """Σ v² of a chunk; NaN or Inf when any value is non-finite. Summed in fp32,
    again in fp64 when that overflows: values pre-multiplied by large token
    weights can square past fp32's range while every one is finite."""
    with np.errstate(over="ignore"):
        fast = float(np.dot(values, values))
    if math.isfinite(fast) or not np.isfinite(values).all():
        return fast
    wide = values.astype(np.float64)
    return float(np.dot(wide, wide))


def _absmax(values: Floats) -> float:
    """max|x| without an |x| temporary; NaN if any element is NaN, 0.0 when empty."""
    if values.shape[0] == 0:
        return 0.0
    return float(np.maximum(values.max(), -values.min()))
