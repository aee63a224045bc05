"""The one chunk-stream reader: what it accepts, and each refusal with its reason."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from protos import ftsync_pb2 as pb
from protos.codec import INT8, MAX_CHUNK_BYTES, iter_chunk_messages
from protos.stream import ChunkReader, StreamEnded, StreamError

NUMEL = 1000
VALUES = np.arange(NUMEL, dtype=np.float32)


def chunk(offset: int, count: int, data: bytes | None = None) -> pb.PullMessage:
    if data is None:
        data = VALUES[offset:offset + count].tobytes()
    return pb.PullMessage(chunk=pb.Chunk(offset=offset, count=count, scale=1.0, data=data))


def read(messages: Sequence[pb.PullMessage], numel: int = NUMEL,
         reader: ChunkReader | None = None) -> np.ndarray:
    out = np.full(numel, -1.0, np.float32)
    reader = reader or ChunkReader(numel, "fragment 2")
    pending = iter(messages)

    async def receive() -> pb.PullMessage | None:
        return next(pending, None)

    asyncio.run(reader.read_into(receive, out))
    return out


def test_chunks_in_order_fill_the_vector_and_count_their_bytes() -> None:
    reader = ChunkReader(NUMEL, "fragment 2")
    out = read([chunk(0, 300), chunk(300, 700)], reader=reader)
    np.testing.assert_array_equal(out, VALUES)
    assert (reader.received, reader.nbytes, reader.complete) == (NUMEL, 4 * NUMEL, True)


@pytest.mark.parametrize("norm", [True, False])
def test_a_reader_asked_for_the_norm_sums_the_squares_of_what_it_decoded(norm: bool) -> None:
    values = np.linspace(-1, 1, 300_001, dtype=np.float32)
    messages = list(iter_chunk_messages(values, INT8, pb.PushMessage, 1 << 20))
    reader = ChunkReader(values.size, "fragment 0", INT8, norm=norm)
    out = np.empty_like(values)
    pending = iter(messages)

    async def receive() -> pb.PushMessage | None:
        return next(pending, None)

    asyncio.run(reader.read_into(receive, out, 0.5))
    expected = float(np.sum(np.square(out.astype(np.float64)))) if norm else 0.0
    assert reader.square_sum == pytest.approx(expected, rel=1e-5)


def test_a_scaled_codec_decodes_weighted() -> None:
    values = np.linspace(-1, 1, 4096, dtype=np.float32)
    messages = list(iter_chunk_messages(values, INT8, pb.PushMessage, 1 << 20))
    out = np.empty_like(values)
    reader = ChunkReader(values.size, "fragment 0", INT8)
    pending = iter(messages)

    async def receive() -> pb.PushMessage | None:
        return next(pending, None)

    asyncio.run(reader.read_into(receive, out, 2.0))
    np.testing.assert_allclose(out, 2 * values, atol=2 * 1 / 127)


# case -> (messages, reason, substrings of the message)
REFUSALS: dict[str, tuple[list[pb.PullMessage], str, tuple[str, ...]]] = {
    "a header among the chunks": (
        [chunk(0, 10), pb.PullMessage(header=pb.PullHeader(fragment=2))],
        "malformed", ("fragment 2", "one header, then chunks")),
    "out of order": ([chunk(10, 10)], "malformed", ("offset 10", "expected offset 0")),
    "repeated": ([chunk(0, 10), chunk(0, 10)], "malformed", ("offset 0", "expected offset 10")),
    "empty chunk": ([chunk(0, 0, b"")], "bad_shape", ("0 elements", "fragment 2")),
    "count beyond the vector": ([chunk(0, NUMEL + 5, bytes(4 * (NUMEL + 5)))], "bad_shape",
                                (f"{NUMEL + 5} elements", f"fragment 2 of {NUMEL}")),
    "short data": ([chunk(0, 10, bytes(39))], "bad_encoding", ("fp32", "40", "39")),
    "long data": ([chunk(0, 10, bytes(41))], "bad_encoding", ("fp32", "40", "41")),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_bad_chunk_is_refused_with_its_reason(case: str) -> None:
    messages, reason, needles = REFUSALS[case]
    with pytest.raises(StreamError) as refused:
        read(messages)
    assert refused.value.reason == reason, refused.value
    for needle in needles:
        assert needle in refused.value.message, (needle, refused.value.message)


def test_oversize_data_is_refused_before_it_is_decoded() -> None:
    count = MAX_CHUNK_BYTES // 4 + 1
    with pytest.raises(StreamError) as refused:
        read([chunk(0, count, bytes(4 * count))], count)
    assert refused.value.reason == "oversize"
    assert str(MAX_CHUNK_BYTES) in refused.value.message


def test_a_stream_that_ends_early_is_told_apart() -> None:
    with pytest.raises(StreamEnded) as ended:
        read([chunk(0, 400)])
    assert ended.value.reason == "bad_shape"
    assert f"400 of {NUMEL}" in ended.value.message


def test_more_after_the_last_chunk_is_refused() -> None:
    reader = ChunkReader(10, "fragment 0")
    reader.refuse_more(None)
    with pytest.raises(StreamError, match="goes on after its 10 elements"):
        reader.refuse_more(chunk(10, 1))
