"""Chips of a simulated cluster: per-chip speed factors exp(σ·Z) and liveness,
shared by the ftsync run and the data-parallel baselines. Kept only when
σ > 0: a month on millions of identical chips needs no per-chip state."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np


class Chips:
    """Per-chip speed factors exp(σ·Z) and liveness, kept only when σ > 0."""

    def __init__(self, n: int, sigma: float, rng: random.Random, seed: int) -> None:
        self.sigma = sigma
        self.rng = rng
        if sigma > 0:
            gen = np.random.default_rng(seed)
            self.speed = np.exp(sigma * gen.standard_normal(n))
            self.alive = np.ones(n, dtype=bool)

    def slowest_of(self, starts: Sequence[int]) -> list[float]:
        """The slowest factor of each group [starts[i], starts[i+1])."""
        if self.sigma == 0:
            return [1.0] * len(starts)
        return [float(x) for x in np.maximum.reduceat(self.speed, np.asarray(starts))]

    def slowest(self, lo: int, hi: int) -> float:
        if self.sigma == 0:
            return 1.0
        alive = self.alive[lo:hi]
        return float(self.speed[lo:hi][alive].max()) if alive.any() else 1.0

    def pick(self, lo: int, hi: int) -> int:
        """A uniformly random live chip of [lo, hi) (-1 when speeds don't vary)."""
        if self.sigma == 0:
            return -1
        while True:
            i = lo + int(self.rng.random() * (hi - lo))
            if self.alive[i]:
                return i

    def remove(self, i: int, slow: float, lo: int, hi: int) -> float:
        """Chip i leaves its group; the group's new slowest factor."""
        if self.sigma == 0:
            return 1.0
        self.alive[i] = False
        return self.slowest(lo, hi) if self.speed[i] >= slow else slow

    def renew(self, i: int, slow: float, lo: int, hi: int) -> float:
        """Chip i is replaced by new hardware (a new speed) and is live."""
        if self.sigma == 0:
            return 1.0
        old, was_alive = float(self.speed[i]), bool(self.alive[i])
        new = math.exp(self.sigma * self.rng.gauss(0.0, 1.0))
        self.speed[i] = new
        self.alive[i] = True
        if was_alive and old >= slow:
            return self.slowest(lo, hi)
        return max(slow, new)
