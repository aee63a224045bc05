"""Merging contributions and applying the outer optimizer, in fp32 numpy.

An open round keeps one accumulator per fragment, whatever the number of
contributors: each contribution is folded in as it completes, so the daemon
never holds a list of full tensors per round. The fragment store calls
these on the daemon's worker threads (numpy releases the GIL).

Weighted mean:  Δ = Σ w·v / Σ w
RDA:            Δ = (Σ w‖v‖ / Σ w) · normalize(Σ w·v/‖v‖ / Σ w)
Outer step:     m ← μ·m + Δ;  Θ ← Θ − lr·(Δ + μ·m)   (Nesterov; plain: Θ − lr·m)
"""

from __future__ import annotations

import math

import numpy as np

from coordinator.config import OuterConfig
from coordinator.policy import MergeRule

# The square sum lives with the codec, which takes it while decoding; re-exported here.
from protos.codec import norm_sq as norm_sq

# Elements per block of the outer step: small enough to stay in cache.
_BLOCK = 1 << 16


class Accumulator:
    """The running merge of one open round of one fragment."""

    def __init__(self, rule: MergeRule) -> None:
        self.rule = rule
        self.sum: np.ndarray | None = None
        # RDA: Σ w·‖v‖, the radial part.
        self.radial = 0.0
        self.count = 0

    def fold(self, values: np.ndarray, weight: float, norm: float,
             prescaled: float = 1.0) -> np.ndarray | None:
        """Add `weight · v` (RDA: `weight · v/‖v‖`) where `values = prescaled · v`.

        The receiver decodes straight into `prescaled · v` with the weight it
        expects, so the usual fold is one pass. `values` is a staging buffer
        the caller gives up: it is rescaled in place only if needed and, for
        the first contribution, becomes the accumulator itself (no zero-fill,
        no extra pass). Returns the buffer when the caller may reuse it, None
        when the accumulator kept it."""
        target = weight
        if self.rule == "rda":
            self.radial += weight * norm
            target = weight / norm if norm > 0 else 0.0
        scale = target / prescaled
        if scale != 1.0:
            np.multiply(values, np.float32(scale), out=values)
        self.count += 1
        if self.sum is None:
            self.sum = values
            return None
        np.add(self.sum, values, out=self.sum)
        return values

    def result(self, total_weight: float) -> np.ndarray:
        """Δ for the round, computed in place in the accumulator."""
        if self.sum is None or total_weight <= 0:
            raise ValueError("cannot merge a round with no weight")
        delta = self.sum
        if self.rule == "rda":
            # Σ w·v/‖v‖ has elements up to Σ w (2^64 each): Σ² may pass fp32's range,
            # so block by block (each widened only if it must be), summed in fp64.
            direction_norm = math.sqrt(sum(norm_sq(delta[start:start + _BLOCK])
                                           for start in range(0, delta.size, _BLOCK)))
            radius = self.radial / total_weight
            scale = radius / direction_norm if direction_norm > 0 else 0.0
        else:
            scale = 1.0 / total_weight
        np.multiply(delta, np.float32(scale), out=delta)
        return delta


def outer_step(config: OuterConfig, params: np.ndarray, momentum: np.ndarray,
               delta: np.ndarray) -> np.ndarray:
    """Apply the outer optimizer; returns the new parameters.

    `momentum` is updated in place; `delta` is consumed and becomes the new
    parameter array, so `params` (which pulls may still be streaming) is
    never written. Works block by block so the only temporary is small.

    Without momentum (μ = 0, the default) there is no buffer to keep, as in torch's
    SGD: `momentum` is not touched (the store keeps it zero, `FragmentStore.resume`),
    which saves two passes here and lets the durable record leave it out."""
    mu = np.float32(config.momentum)
    neg_lr = np.float32(-config.lr)
    if mu == 0:
        np.multiply(delta, neg_lr, out=delta)
        np.add(delta, params, out=delta)
        return delta
    tmp = np.empty(min(_BLOCK, delta.size), dtype=np.float32)
    for start in range(0, delta.size, _BLOCK):
        d = delta[start:start + _BLOCK]
        m = momentum[start:start + _BLOCK]
        t = tmp[:d.size]
        np.multiply(m, mu, out=m)
        np.add(m, d, out=m)
        if config.nesterov:
            np.multiply(m, mu, out=t)
            np.add(d, t, out=d)
        else:
            np.copyto(d, m)
        np.multiply(d, neg_lr, out=d)
        np.add(d, params[start:start + _BLOCK], out=d)
    return delta


def first_non_finite(values: np.ndarray) -> int | None:
    """Index of the first NaN/Inf, for an error message that points at it."""
    bad = np.flatnonzero(~np.isfinite(values))
    return int(bad[0]) if bad.size else None
