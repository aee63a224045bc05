"""Splitting a torch model into fragments, the same way on every learner.

Whole tensors are bin-packed greedily (largest first, into the lightest
fragment) so fragments carry balanced bytes; ties break by name, so the
plan depends only on the model's parameter names, shapes and dtypes. The
layout hash covers exactly those, per fragment: a learner with another
model or fragment count is refused by the coordinator with a clear error.
Each fragment is seen as one flat fp32 vector, read from and written back
to the model's parameters on whatever device they live.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch


@dataclass(frozen=True)
class Fragment:
    index: int
    names: tuple[str, ...]
    numel: int


@dataclass(frozen=True)
class FragmentPlan:
    fragments: tuple[Fragment, ...]
    hash: str

    @property
    def numels(self) -> list[int]:
        return [f.numel for f in self.fragments]


K = TypeVar("K", str, int)


def pack_balanced(sizes: Mapping[K, int], count: int, what: str) -> list[list[K]]:
    """Greedy balanced bin-packing: largest item first, into the lightest bin;
    ties break by key, so the result depends only on keys and sizes."""
    if count < 1:
        raise ValueError(f"fragments must be at least 1, got {count}")
    if count > len(sizes):
        raise ValueError(f"cannot split {len(sizes)} {what} into {count} fragments; "
                         f"use at most {len(sizes)}")
    loads = [0] * count
    members: list[list[K]] = [[] for _ in range(count)]
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        lightest = min(range(count), key=lambda i: (loads[i], i))
        loads[lightest] += sizes[key]
        members[lightest].append(key)
    return members


def plan_fragments(model: torch.nn.Module, count: int) -> FragmentPlan:
    """Balanced bin-packing of `model`'s trainable tensors (by bytes) into `count` fragments."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    members = pack_balanced({name: p.numel() * p.element_size() for name, p in params}, count,
                            "parameter tensors")
    by_name = dict(params)
    digest = hashlib.sha256()
    fragments = []
    for index, names in enumerate(members):
        # Within a fragment, tensors keep the model's own order.
        ordered = tuple(n for n, _ in params if n in set(names))
        for name in ordered:
            p = by_name[name]
            digest.update(f"{index}:{name}:{tuple(p.shape)}:{p.dtype};".encode())
        fragments.append(Fragment(index, ordered, sum(by_name[n].numel() for n in ordered)))
    return FragmentPlan(tuple(fragments), digest.hexdigest()[:16])


class FragmentView:
    """Reads and writes a model's fragments as flat fp32 numpy vectors."""

    def __init__(self, model: torch.nn.Module, plan: FragmentPlan) -> None:
        self.plan = plan
        params = dict(model.named_parameters())
        self._tensors = [[params[name] for name in f.names] for f in plan.fragments]

    def read(self, fragment: int) -> np.ndarray:
        tensors = self._tensors[fragment]
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
            return flat.cpu().numpy().copy()

    def write(self, fragment: int, values: np.ndarray) -> None:
        tensors = self._tensors[fragment]
        source = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                t.copy_(source[offset:offset + n].view(t.shape).to(t.device, t.dtype))
                offset += n
