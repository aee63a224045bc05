"""A synthetic task: linear regression in numpy, for scripted learners.

Every learner sees its own shard of one regression problem (the same true
weights, its own features and noise) and runs momentum SGD on it; the
held-out mean squared error shows whether the merged model improves. It is
small and needs no torch, so the daemon's integration tests and the chaos
harness can run many learners on two cores, and it exercises the real
streaming runtime (`learner.streaming`) end to end.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np


def layout_hash(numels: list[int], name: str) -> str:
    """Same model and fragment count → same hash, on every learner: the first 16 hex
    digits of SHA-256 over `NAME:[n0, n1, ...]` (docs/protocol.md, "Layout hash"; the
    synthetic task's NAME is `synthetic-DIM`)."""
    listed = ", ".join(str(int(n)) for n in numels)
    return hashlib.sha256(f"{name}:[{listed}]".encode()).hexdigest()[:16]


@dataclass
class RegressionTask:
    """Least squares on `dim` features, shard `shard` of the training data."""

    dim: int = 1024
    shard: int = 0
    batch: int = 32
    lr: float = 0.002
    momentum: float = 0.9
    noise: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        truth_rng = np.random.default_rng(self.seed)
        self.true_w = truth_rng.normal(size=self.dim).astype(np.float32) / np.sqrt(self.dim)
        self.rng = np.random.default_rng([self.seed, self.shard, 1])
        eval_rng = np.random.default_rng([self.seed, 2**31 - 1])
        self.eval_x = eval_rng.normal(size=(512, self.dim)).astype(np.float32)
        self.eval_y = self.eval_x @ self.true_w
        init_rng = np.random.default_rng([self.seed, self.shard, 2])
        self.params = init_rng.normal(size=self.dim).astype(np.float32) * 0.1
        self.velocity = np.zeros_like(self.params)

    def train_step(self) -> tuple[float, int]:
        """One inner step; returns (train loss, tokens = examples seen)."""
        x = self.rng.normal(size=(self.batch, self.dim)).astype(np.float32)
        y = x @ self.true_w + self.noise * self.rng.normal(size=self.batch).astype(np.float32)
        error = x @ self.params - y
        grad = (2.0 / self.batch) * (x.T @ error)
        self.velocity = self.momentum * self.velocity + grad
        self.params -= self.lr * self.velocity
        return float(np.mean(error**2)), self.batch

    def eval_loss(self) -> float:
        return float(np.mean((self.eval_x @ self.params - self.eval_y) ** 2))

    def fragment_bounds(self, fragments: int) -> list[tuple[int, int]]:
        """Fragment p holds elements floor(p·dim/P) to floor((p+1)·dim/P), in integer
        arithmetic so that any learner computes the same edges."""
        edges = [p * self.dim // fragments for p in range(fragments + 1)]
        return list(itertools.pairwise(edges))
