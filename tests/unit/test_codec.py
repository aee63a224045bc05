"""Tests for protos.codec: the error bound its docstring states for each codec, weights,
chunking, non-finite values, and error messages that name the problem."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numpy.typing import NDArray

from protos import ftsync_pb2
from protos.codec import (
    BF16,
    CODECS,
    DEFAULT_CHUNK_BYTES,
    E3M0,
    FP32,
    INT8,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    Codec,
    CodecError,
    chunk_elements,
    codec_for,
    codec_named,
    decode_chunk_into,
    iter_chunks,
)

Floats = NDArray[np.float32]

# Slack for results among fp32 subnormals, where precision is absolute: a subnormal int8
# scale is off by up to half of 2^-149, times |q| <= 127.
TINY = 2.0**-140

vectors = hnp.arrays(
    np.float32,
    st.integers(0, 257),
    elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=False),
)
# Weights the merge may use; a subnormal fp32 weight would make the reference imprecise.
weights = st.floats(-4, 4).filter(lambda w: w == 0 or (abs(w) >= 2**-20 and w != 1.0))
codecs = pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
# Examples take about a millisecond; a deadline would only flake on a loaded machine.
relaxed = settings(deadline=None)


def round_trip(codec: Codec, x: Floats, weight: float = 1.0) -> Floats:
    data, scale = codec.encode(x)
    assert len(data) == codec.encoded_bytes(x.shape[0])
    out: Floats = np.full(x.shape[0], np.nan, np.float32)
    codec.decode_into(data, scale, out, weight)
    return out


def f32(*values: float) -> Floats:
    return np.array(values, np.float32)


# Bounds ------------------------------------------------------------------------------------


@relaxed
@given(vectors)
def test_fp32_round_trip_is_bit_exact(x: Floats) -> None:
    assert FP32.encode(x)[1] == 1.0
    np.testing.assert_array_equal(round_trip(FP32, x).view(np.uint32), x.view(np.uint32))


@relaxed
@given(vectors)
def test_bf16_relative_error_at_most_2_pow_minus_8(x: Floats) -> None:
    y = round_trip(BF16, x).astype(np.float64)
    assert np.all(np.abs(y - x) <= 2.0**-8 * np.abs(x))


def _bf16_reference(bits: np.ndarray) -> np.ndarray:
    """Nearest bf16 by comparing the two neighbours in float64; ties go to the even one."""
    low = bits & np.uint32(0xFFFF0000)
    high = low + np.uint32(0x10000)
    x = bits.view(np.float32).astype(np.float64)
    down = np.abs(x - low.view(np.float32))
    up = np.abs(high.view(np.float32).astype(np.float64) - x)
    take_high = (up < down) | ((up == down) & ((low >> 16) & 1 == 1))
    return np.where(take_high, high, low) >> 16


@relaxed
@given(
    hnp.arrays(
        np.uint32,
        st.integers(1, 16),
        elements=st.builds(
            lambda top, bottom: (top << 16) | bottom,
            # Finite values below 2^127, either sign, so the upper neighbour stays finite.
            st.integers(0, 0x7EFF) | st.integers(0x8000, 0xFEFF),
            st.sampled_from([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF]) | st.integers(0, 0xFFFF),
        ),
    )
)
def test_bf16_is_round_to_nearest_even(bits: np.ndarray) -> None:
    data, _ = BF16.encode(bits.view(np.float32))
    np.testing.assert_array_equal(np.frombuffer(data, "<u2"), _bf16_reference(bits))


def test_bf16_ties_go_to_even_not_truncated() -> None:
    # Halfway cases between neighbours 2^-7 apart: 1 + 2^-8 -> 1, 1 + 3·2^-8 -> 1 + 2^-6.
    y = round_trip(BF16, f32(1 + 2**-8, 1 + 3 * 2**-8, -(1 + 3 * 2**-8)))
    np.testing.assert_array_equal(y, f32(1, 1 + 2**-6, -(1 + 2**-6)))


@relaxed
@given(vectors)
def test_int8_absolute_error_at_most_half_scale(x: Floats) -> None:
    data, scale = INT8.encode(x)
    assert scale == (np.float32(np.abs(x).max()) / np.float32(127) if x.size else 0.0)
    assert np.all(np.abs(np.frombuffer(data, np.int8).astype(np.int16)) <= 127)
    y = round_trip(INT8, x).astype(np.float64)
    assert np.all(np.abs(y - x) <= scale * (0.5 + 2.0**-15) + TINY)


@relaxed
@given(vectors)
def test_e3m0_relative_and_absolute_bounds(x: Floats) -> None:
    _, scale = E3M0.encode(x)
    m = float(np.abs(x).max()) if x.size else 0.0
    assert scale == m
    y = round_trip(E3M0, x).astype(np.float64)
    err = np.abs(y - x)
    ax = np.abs(x).astype(np.float64)
    # Non-zero results are within a factor √2 in log2 space.
    nonzero = y != 0
    assert np.all(err[nonzero] <= (math.sqrt(2) - 1) * (1 + 2**-20) * ax[nonzero] + TINY)
    # Only values under 2^-6.5·m become zero; so below 2^-6·m the error is <= 2^-6.5·m.
    assert np.all(ax[~nonzero] <= 2**-6.5 * m * (1 + 2**-20))
    small = ax < 2**-6 * m
    assert np.all(err[small] <= 2**-6.5 * m * (1 + 2**-20) + TINY)


def test_e3m0_rounds_to_nearest_power_of_two_in_log2_space() -> None:
    m = 3.0
    ks = np.arange(0, -7, -1)
    exact = m * 2.0**ks
    x = np.concatenate([[m], exact, -exact, m * 2.0 ** (ks - 0.49), m * 2.0 ** (ks - 0.51)])
    want = np.concatenate([[m], exact, -exact, exact, m * 2.0 ** (ks - 1.0)])
    want[np.abs(want) < m * 2**-6] = 0.0  # 2^-7·m is below the smallest code
    np.testing.assert_array_equal(round_trip(E3M0, x.astype(np.float32)), want)


def test_e3m0_packs_first_element_in_low_nibble_and_pads_odd_count() -> None:
    data, scale = E3M0.encode(f32(1.0, -0.5, -1.0))
    assert scale == 1.0
    # 1.0 is e=7 (0x7); -0.5 is sign|e=6 (0xE); -1.0 is 0xF with a zero pad nibble above.
    assert data == bytes([0xE7, 0x0F])


@codecs
@relaxed
@given(x=vectors)
def test_nonzero_results_keep_the_sign(codec: Codec, x: Floats) -> None:
    y = round_trip(codec, x)
    nonzero = y != 0
    assert np.array_equal(np.signbit(y[nonzero]), np.signbit(x[nonzero]))


@codecs
@relaxed
@given(x=vectors, weight=weights)
def test_weight_scales_the_decoded_values(codec: Codec, x: Floats, weight: float) -> None:
    plain = round_trip(codec, x)
    weighted = round_trip(codec, x, weight)
    np.testing.assert_allclose(weighted, np.float32(weight) * plain, rtol=2**-21, atol=TINY)


@codecs
def test_decode_accepts_a_memoryview(codec: Codec) -> None:
    x = np.linspace(-1, 1, 101, dtype=np.float32)
    data, scale = codec.encode(x)
    out = np.empty_like(x)
    codec.decode_into(memoryview(data), scale, out)
    np.testing.assert_array_equal(out, round_trip(codec, x))


# Decoding with the norm in the same pass ---------------------------------------------------


@codecs
@pytest.mark.parametrize("count", [1, 7, (1 << 17) - 1, (1 << 17) + 1, 3 * (1 << 17) + 5])
def test_decode_norm_writes_what_decode_does_and_its_square_sum(codec: Codec,
                                                                count: int) -> None:
    # Sizes on both sides of the codec's block, odd ones too (e3m0 packs two per byte).
    x = np.random.default_rng(count).standard_normal(count).astype(np.float32)
    data, scale = codec.encode(x)
    expected = np.empty_like(x)
    codec.decode_into(data, scale, expected, 0.375)
    out = np.full_like(x, np.nan)
    total = codec.decode_norm_into(data, scale, out, 0.375)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    # Summed in fp32 by blocks rather than over the whole vector: as close to the exact sum.
    assert total == pytest.approx(float(np.sum(np.square(expected.astype(np.float64)))),
                                  rel=1e-4)


def test_decode_norm_weights_an_fp32_frame_received_in_place() -> None:
    # The bulk channel receives fp32 frames straight into the staging buffer.
    x = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
    staging = x.copy()
    total = FP32.decode_norm_into(staging.data.cast("B"), 1.0, staging, 2.0)
    np.testing.assert_array_equal(staging, np.float32(2.0) * x)
    assert total == pytest.approx(float(np.sum(np.square(2.0 * x.astype(np.float64)))),
                                  rel=1e-5)


@pytest.mark.parametrize("codec", [INT8, E3M0], ids=lambda c: c.name)
def test_decode_norm_of_a_non_finite_scale_is_nan(codec: Codec) -> None:
    out = np.zeros(10, np.float32)
    assert math.isnan(codec.decode_norm_into(bytes(codec.encoded_bytes(10)), math.inf, out))
    assert np.isnan(out).all()


def test_decode_norm_of_a_non_finite_value_is_not_finite() -> None:
    x = np.ones(200_000, np.float32)
    x[150_000] = math.inf
    data, scale = FP32.encode(x)
    assert not math.isfinite(FP32.decode_norm_into(data, scale, np.empty_like(x)))


@codecs
def test_decode_norm_checks_the_byte_count_before_writing(codec: Codec) -> None:
    out = np.zeros(16, np.float32)
    with pytest.raises(CodecError, match=f"{codec.name} needs {codec.encoded_bytes(16)} bytes"):
        codec.decode_norm_into(bytes(codec.encoded_bytes(16) + 1), 1.0, out)
    assert not out.any()


# Non-finite values -------------------------------------------------------------------------


@codecs
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_decodes_to_non_finite(codec: Codec, bad: float) -> None:
    x = np.linspace(-1, 1, 11, dtype=np.float32)
    x[4] = bad
    assert not np.all(np.isfinite(round_trip(codec, x)))


def test_bf16_keeps_nan_and_inf_in_place() -> None:
    bits = np.array(
        [0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0x7FC00000, 0x7F800000, 0xFF800000, 0x3F800000],
        np.uint32,
    )
    y = round_trip(BF16, bits.view(np.float32))
    assert np.all(np.isnan(y[:4]))
    np.testing.assert_array_equal(y[4:], f32(math.inf, -math.inf, 1.0))


@pytest.mark.parametrize("codec", [INT8, E3M0], ids=lambda c: c.name)
def test_non_finite_scale_decodes_to_nan(codec: Codec) -> None:
    data, _ = codec.encode(f32(1.0, 2.0, 3.0))
    for scale in (math.nan, math.inf):
        out = np.zeros(3, np.float32)
        codec.decode_into(data, scale, out)
        assert np.all(np.isnan(out))


@pytest.mark.parametrize("codec", [INT8, E3M0], ids=lambda c: c.name)
def test_all_zero_chunk_has_zero_scale(codec: Codec) -> None:
    data, scale = codec.encode(np.zeros(5, np.float32))
    assert scale == 0.0
    np.testing.assert_array_equal(round_trip(codec, np.zeros(5, np.float32)), np.zeros(5))
    assert data == bytes(codec.encoded_bytes(5))


# Chunking ----------------------------------------------------------------------------------


@codecs
@pytest.mark.parametrize(
    "chunk_bytes", [MIN_CHUNK_BYTES, MIN_CHUNK_BYTES + 3, DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES]
)
def test_chunk_elements_is_the_most_that_fit(codec: Codec, chunk_bytes: int) -> None:
    n = chunk_elements(codec, chunk_bytes)
    step = 2 if codec is E3M0 else 1
    assert n % step == 0
    assert codec.encoded_bytes(n) <= chunk_bytes < codec.encoded_bytes(n + step)


@codecs
def test_iter_chunks_covers_the_vector_once_in_order(codec: Codec) -> None:
    step = chunk_elements(codec, MIN_CHUNK_BYTES)
    x = np.random.default_rng(0).standard_normal(2 * step + 12345, dtype=np.float32)
    chunks = list(iter_chunks(x, codec, MIN_CHUNK_BYTES))
    assert [(c.offset, c.count) for c in chunks] == [
        (0, step),
        (step, step),
        (2 * step, 12345),
    ]
    out = np.full_like(x, np.nan)
    for c in chunks:
        assert len(c.data) <= MIN_CHUNK_BYTES
        decode_chunk_into(c, codec, out)
        part = x[c.offset : c.offset + c.count]
        np.testing.assert_array_equal(out[c.offset : c.offset + c.count], round_trip(codec, part))
    if codec is FP32:
        np.testing.assert_array_equal(out, x)


def test_iter_chunks_default_size_and_weight() -> None:
    x = np.arange(DEFAULT_CHUNK_BYTES // 4 + 1, dtype=np.float32)
    chunks = list(iter_chunks(x, FP32))
    assert [c.count for c in chunks] == [DEFAULT_CHUNK_BYTES // 4, 1]
    out = np.zeros_like(x)
    for c in chunks:
        decode_chunk_into(c, FP32, out, weight=0.5)
    np.testing.assert_array_equal(out, x * np.float32(0.5))


@codecs
def test_empty_vector_yields_no_chunks(codec: Codec) -> None:
    assert list(iter_chunks(np.zeros(0, np.float32), codec)) == []


# Bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [0, MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1])
def test_chunk_bytes_outside_range_is_rejected_before_iterating(chunk_bytes: int) -> None:
    expected = rf"chunk_bytes {chunk_bytes} outside \[1048576, 4194304\]"
    with pytest.raises(CodecError, match=expected):
        iter_chunks(np.zeros(4, np.float32), FP32, chunk_bytes)


def test_wrong_byte_count_names_codec_counts_and_offset() -> None:
    x = np.ones(1000, np.float32)
    data, scale = INT8.encode(x)
    with pytest.raises(CodecError, match=r"^int8 needs 1000 bytes for 1000 elements, got 999$"):
        INT8.decode_into(data[:-1], scale, np.empty(1000, np.float32))
    chunk = ftsync_pb2.Chunk(offset=4096, count=1000, scale=scale, data=data[:-1])
    with pytest.raises(
        CodecError,
        match=r"^chunk at offset 4096: int8 needs 1000 bytes for 1000 elements, got 999$",
    ):
        decode_chunk_into(chunk, INT8, np.empty(8192, np.float32))


@codecs
def test_every_codec_checks_its_byte_count(codec: Codec) -> None:
    data, scale = codec.encode(np.ones(7, np.float32))
    with pytest.raises(CodecError, match=f"{codec.name} needs {len(data)} bytes for 7 elements"):
        codec.decode_into(data + b"\0", scale, np.empty(7, np.float32))


@pytest.mark.parametrize("codec", [INT8, E3M0], ids=lambda c: c.name)
def test_negative_scale_is_rejected(codec: Codec) -> None:
    data, _ = codec.encode(f32(1.0, 2.0))
    with pytest.raises(CodecError, match=f"{codec.name} scale must be >= 0, got -0.5"):
        codec.decode_into(data, -0.5, np.empty(2, np.float32))


def test_unscaled_codecs_ignore_the_scale() -> None:
    # proto3 delivers 0.0 for a scale the sender never set.
    data, _ = FP32.encode(f32(2.0))
    out = np.empty(1, np.float32)
    FP32.decode_into(data, -3.0, out)
    assert out[0] == 2.0


def test_chunk_past_the_end_names_offset_count_and_numel() -> None:
    chunk = ftsync_pb2.Chunk(offset=90, count=20, data=bytes(80))
    with pytest.raises(CodecError, match=r"^chunk at offset 90 with count 20 exceeds numel 100$"):
        decode_chunk_into(chunk, FP32, np.zeros(100, np.float32))


def test_codec_lookup_by_wire_value_and_name() -> None:
    for codec in CODECS:
        assert codec_for(codec.wire) is codec
        assert codec_named(codec.name) is codec
        assert ftsync_pb2.Codec.Name(codec.wire) == f"CODEC_{codec.name.upper()}"
    with pytest.raises(CodecError, match=r"^unknown codec value 7$"):
        codec_for(7)
    with pytest.raises(CodecError, match="unknown codec 'fp8'; valid: fp32, bf16, int8, e3m0"):
        codec_named("fp8")


def test_encode_wants_a_float32_vector() -> None:
    with pytest.raises(CodecError, match=r"1-D float32 array, got float64 of shape \(3,\)"):
        FP32.encode(np.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(CodecError, match=r"1-D float32 array, got float32 of shape \(2, 2\)"):
        list(iter_chunks(np.zeros((2, 2), np.float32), FP32))


def test_decode_wants_a_contiguous_float32_vector() -> None:
    data, scale = FP32.encode(f32(1.0, 2.0))
    with pytest.raises(CodecError, match="contiguous 1-D float32"):
        FP32.decode_into(data, scale, np.zeros(4, np.float32)[::2])
