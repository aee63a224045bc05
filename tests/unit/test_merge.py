"""Tests for coordinator.merge: the fp32 merge rules and the outer step against references.

The weighted mean and RDA are checked against float64 numpy computed straight from the
formulas; the outer step against torch.optim.SGD, the optimizer DiLoCo specifies. Sizes cross
the outer step's internal block (65536 elements) so that block edges are covered.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from coordinator.config import OuterConfig
from coordinator.merge import Accumulator, first_non_finite, norm_sq, outer_step

Floats = NDArray[np.float32]

BLOCK = 1 << 16
# Small sizes, the block size itself, and a size just past one block.
SIZES = [1, 2, 7, 1000, BLOCK, 70000]

sizes = st.sampled_from(SIZES)
seeds = st.integers(0, 2**32 - 1)
weights = st.floats(0.1, 10.0)
fast = settings(max_examples=12, deadline=None)


def uniform(rng: np.random.Generator, size: int) -> Floats:
    return rng.uniform(-1.0, 1.0, size).astype(np.float32)


def l2(values: NDArray[np.floating]) -> float:
    return float(np.sqrt(np.dot(values.astype(np.float64), values.astype(np.float64))))


# -- Accumulator -----------------------------------------------------------------------------


@fast
@given(size=sizes, seed=seeds, ws=st.lists(weights, min_size=1, max_size=8))
def test_mean_equals_the_float64_weighted_mean(size: int, seed: int, ws: list[float]) -> None:
    rng = np.random.default_rng(seed)
    vectors = [uniform(rng, size) for _ in ws]
    acc = Accumulator("mean")
    for v, w in zip(vectors, ws, strict=True):
        acc.fold(v.copy(), w, l2(v))
    result = acc.result(sum(ws))
    expected = sum(w * v.astype(np.float64) for v, w in zip(vectors, ws, strict=True)) / sum(ws)
    assert result.dtype == np.float32 and result.shape == (size,)
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6)
    assert acc.count == len(ws)


@fast
@given(size=sizes, seed=seeds, ws=st.lists(weights, min_size=1, max_size=8),
       scales=st.lists(st.floats(0.01, 100.0), min_size=8, max_size=8))
def test_rda_equals_the_formula(size: int, seed: int, ws: list[float],
                                scales: list[float]) -> None:
    # Vectors of very different norms: RDA keeps the mean norm and the mean direction.
    rng = np.random.default_rng(seed)
    vectors = [(uniform(rng, size) * np.float32(s)) for s, _ in zip(scales, ws, strict=False)]
    acc = Accumulator("rda")
    for v, w in zip(vectors, ws, strict=True):
        acc.fold(v.copy(), w, l2(v))
    result = acc.result(sum(ws))
    v64 = [v.astype(np.float64) for v in vectors]
    radius = sum(w * l2(v) for v, w in zip(v64, ws, strict=True)) / sum(ws)
    direction = sum(w * v / l2(v) for v, w in zip(v64, ws, strict=True))
    expected = radius * direction / l2(direction)
    assert result.dtype == np.float32
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-6 * max(1.0, radius))
    assert l2(result) == pytest.approx(radius, rel=1e-5)


def test_rda_of_one_vector_is_that_vector() -> None:
    v = np.array([3.0, -4.0, 0.0], np.float32)
    acc = Accumulator("rda")
    acc.fold(v.copy(), 2.5, 5.0)
    np.testing.assert_allclose(acc.result(2.5), v, rtol=1e-6)


def test_rda_zero_norm_contribution_adds_no_direction() -> None:
    acc = Accumulator("rda")
    acc.fold(np.array([0.0, 2.0], np.float32), 1.0, 2.0)
    acc.fold(np.zeros(2, np.float32), 1.0, 0.0)
    # Radius: (1·2 + 1·0)/2 = 1; direction: that of the non-zero contribution.
    result = acc.result(2.0)
    assert np.isfinite(result).all()
    np.testing.assert_allclose(result, [0.0, 1.0], rtol=1e-6)


def test_rda_with_token_weights_near_the_limit_keeps_its_direction() -> None:
    """Weights reach 2^64 (c_tokens²/c_steps): the direction's Σ² then passes fp32's
    range while every element is finite; the merge must not come out as zero."""
    vectors = [np.array([3.0, -4.0, 0.0], np.float32), np.array([0.0, -1.0, 1.0], np.float32),
               np.array([2.0, -2.0, 1.0], np.float32), np.array([1.0, -3.0, 0.5], np.float32)]
    results = []
    for weight in (1.0, 2.0**64):
        acc = Accumulator("rda")
        for v in vectors:
            acc.fold(v.copy(), weight, l2(v))
        results.append(acc.result(len(vectors) * weight))
    assert np.isfinite(results[1]).all()
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_fold_ownership_contract(rule: str) -> None:
    acc = Accumulator(rule)  # type: ignore[arg-type]
    first = np.full(5, 1.0, np.float32)
    second = np.full(5, 2.0, np.float32)
    third = np.full(5, 3.0, np.float32)
    # The first buffer becomes the accumulator: the caller must not reuse it.
    assert acc.fold(first, 1.0, l2(first)) is None
    assert acc.sum is first
    # Later buffers are handed back for reuse, and the sum stays in the first one.
    assert acc.fold(second, 1.0, l2(second)) is second
    assert acc.fold(third, 1.0, l2(third)) is third
    assert acc.sum is first
    # The result is computed in place, in the accumulator's buffer.
    assert acc.result(3.0) is first


def test_mean_with_equal_weights_is_exact_on_small_integers() -> None:
    acc = Accumulator("mean")
    for values in ([1, 2, 3], [3, 2, 1], [5, 5, 5], [-1, 3, 7]):
        acc.fold(np.array(values, np.float32), 1.0, 0.0)
    np.testing.assert_array_equal(acc.result(4.0), [2.0, 3.0, 4.0])


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_result_without_weight_is_an_error(rule: str) -> None:
    with pytest.raises(ValueError, match="no weight"):
        Accumulator(rule).result(1.0)  # type: ignore[arg-type]
    acc = Accumulator(rule)  # type: ignore[arg-type]
    acc.fold(np.ones(3, np.float32), 1.0, l2(np.ones(3)))
    with pytest.raises(ValueError, match="no weight"):
        acc.result(0.0)


# -- outer step ------------------------------------------------------------------------------


def torch_steps(config: OuterConfig, params: Floats, deltas: list[Floats]
                ) -> tuple[Floats, Floats]:
    """Parameters and momentum buffer after torch's SGD takes `deltas` as gradients."""
    p = torch.nn.Parameter(torch.from_numpy(params.copy()))
    opt = torch.optim.SGD([p], lr=config.lr, momentum=config.momentum,
                          nesterov=config.nesterov)
    for delta in deltas:
        p.grad = torch.from_numpy(delta.copy())
        opt.step()
    buf = opt.state[p]["momentum_buffer"]
    return p.detach().numpy(), buf.numpy()


@fast
@given(size=sizes, seed=seeds, lr=st.floats(0.01, 1.0), mu=st.floats(0.05, 0.99),
       nesterov=st.booleans(), steps=st.integers(1, 4))
def test_outer_step_matches_torch_sgd(size: int, seed: int, lr: float, mu: float,
                                      nesterov: bool, steps: int) -> None:
    config = OuterConfig(lr=lr, momentum=mu, nesterov=nesterov)
    rng = np.random.default_rng(seed)
    params0 = rng.standard_normal(size).astype(np.float32)
    deltas = [uniform(rng, size) for _ in range(steps)]
    params, momentum = params0.copy(), np.zeros(size, np.float32)
    for delta in deltas:
        params = outer_step(config, params, momentum, delta.copy())
    want_params, want_momentum = torch_steps(config, params0, deltas)
    assert params.dtype == np.float32 and momentum.dtype == np.float32
    np.testing.assert_allclose(momentum, want_momentum, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(params, want_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_without_momentum_is_plain_sgd(nesterov: bool) -> None:
    # torch refuses nesterov with zero momentum; with μ = 0 both forms are Θ − lr·Δ.
    config = OuterConfig(lr=0.5, momentum=0.0, nesterov=nesterov)
    rng = np.random.default_rng(7)
    params, delta = uniform(rng, 70000), uniform(rng, 70000)
    # Not read, not written: the store keeps it zero (the file then leaves it out).
    momentum = uniform(rng, 70000)
    kept = momentum.copy()
    new = outer_step(config, params, momentum, delta.copy())
    np.testing.assert_allclose(new, params - np.float32(0.5) * delta, rtol=1e-6, atol=1e-7)
    again = outer_step(config, new, momentum, delta.copy())
    np.testing.assert_allclose(again, new - np.float32(0.5) * delta, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(momentum, kept)


def test_the_default_outer_step_never_goes_farther_than_lr_times_the_merge() -> None:
    # Rounds whose outer gradients point the same way (lock-step rounds at small H):
    # DiLoCo's Nesterov 0.9 would step 1.9·lr, 2.71·lr, ... of each; the defaults
    # step lr of each, however many such rounds come (BENCHMARKS.md "Outer defaults").
    rng = np.random.default_rng(3)
    delta = uniform(rng, 1000)
    params, momentum = np.zeros(1000, np.float32), np.zeros(1000, np.float32)
    config = OuterConfig().scaled(1.0)
    for _ in range(10):
        new = outer_step(config, params, momentum, delta.copy())
        np.testing.assert_allclose(params - new, np.float32(config.lr) * delta, rtol=1e-5)
        params = new


def test_a_round_steps_with_lr_and_momentum_scaled_unless_adaptive_is_off() -> None:
    scaled = OuterConfig(momentum=0.9).scaled(0.25)
    assert (scaled.lr, scaled.momentum, scaled.nesterov) == (pytest.approx(0.175),
                                                             pytest.approx(0.225), True)
    assert OuterConfig().scaled(1.0) == OuterConfig()
    fixed = OuterConfig(adaptive=False)
    assert fixed.scaled(0.25) == fixed


@pytest.mark.parametrize("size", [3, 70000])
def test_outer_step_never_writes_params_and_returns_delta(size: int) -> None:
    rng = np.random.default_rng(size)
    params = uniform(rng, size)
    before = params.copy()
    # A pull may still be streaming `params`: read-only makes any write raise.
    params.setflags(write=False)
    momentum = uniform(rng, size)
    delta = uniform(rng, size)
    out = outer_step(OuterConfig(momentum=0.9), params, momentum, delta)
    assert out is delta
    np.testing.assert_array_equal(params, before)
    assert not np.shares_memory(out, params)


# -- norm_sq and first_non_finite --------------------------------------------------------------


@fast
@given(size=sizes, seed=seeds, scale=st.floats(1e-3, 1e3))
def test_norm_sq_equals_float64_sum_of_squares(size: int, seed: int, scale: float) -> None:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(size) * scale).astype(np.float32)
    expected = float(np.sum(values.astype(np.float64) ** 2))
    got = norm_sq(values)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-5)


def test_norm_sq_of_zeros_and_empty() -> None:
    assert norm_sq(np.zeros(10, np.float32)) == 0.0
    assert norm_sq(np.zeros(0, np.float32)) == 0.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_norm_sq_is_not_finite_for_non_finite_values(bad: float) -> None:
    values = np.ones(70000, np.float32)
    values[12345] = bad
    assert not np.isfinite(norm_sq(values))


def test_norm_sq_past_fp32_range_is_summed_in_fp64() -> None:
    values = np.full(4, 1e30, np.float32)
    assert norm_sq(values) == pytest.approx(4 * float(values[0]) ** 2, rel=1e-12)


@given(size=st.integers(1, 70000), data=st.data())
@settings(max_examples=50, deadline=None)
def test_first_non_finite_finds_the_first_bad_index(size: int, data: st.DataObject) -> None:
    values = np.ones(size, np.float32)
    bad = data.draw(st.lists(st.tuples(st.integers(0, size - 1),
                                       st.sampled_from([np.nan, np.inf, -np.inf])),
                             min_size=1, max_size=5))
    for index, value in bad:
        values[index] = value
    assert first_non_finite(values) == min(index for index, _ in bad)


@pytest.mark.parametrize("size", [0, 1, 70000])
def test_first_non_finite_of_a_finite_vector_is_none(size: int) -> None:
    values = np.full(size, np.finfo(np.float32).max, np.float32)
    if size:
        values[0] = -np.finfo(np.float32).tiny
    assert first_non_finite(values) is None
