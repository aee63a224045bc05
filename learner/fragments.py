"""Splitting a torch model into fragments, the same way on every learner.

Whole tensors are bin-packed greedily (largest first, into the lightest
fragment) so fragments carry balanced bytes; ties break by name, so the
plan depends only on the model's parameter names, shapes and dtypes. The
layout hash covers exactly those, per fragment: a learner with another
model or fragment count is refused by the coordinator with a clear error.
Each fragment is seen as one flat fp32 vector, read from and written back
to the model's parameters on whatever device they live.

On a CUDA model the values pass through one pinned host buffer per fragment,
copied with non-blocking copies on a side stream, so pushes and applies do
not stall the training stream: a write returns once its values are in the
pinned buffer, and the training stream waits, on the device, for the copy
into the parameters before its next kernel; a read waits only for its own
copy, ordered after the training work queued before it. On CPU the same path
runs on plain (unpinned) buffers, where every copy is synchronous.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
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
        devices = {t.device for tensors in self._tensors for t in tensors}
        device = devices.pop() if len(devices) == 1 else None
        # The side stream's device: the model's, when all of it is on one GPU.
        self._cuda = device if device is not None and device.type == "cuda" else None
        self._side = (None if self._cuda is None
                      else torch.cuda.Stream(self._cuda))  # type: ignore[no-untyped-call]
        self._host = [torch.empty(f.numel, dtype=torch.float32,
                                  pin_memory=self._cuda is not None) for f in plan.fragments]
        # Per fragment, the copy out of its host buffer still in flight (CUDA only).
        self._writing: list[torch.cuda.Event | None] = [None] * len(plan.fragments)

    @property
    def pinned(self) -> bool:
        """Whether the host buffers are pinned (the model is on one CUDA device)."""
        return self._cuda is not None

    def read(self, fragment: int) -> np.ndarray:
        """The fragment's values as of the training work queued so far (a new array)."""
        host = self._idle_host(fragment)
        with self._on_side_stream() as done:
            offset = 0
            for t in self._tensors[fragment]:
                n = t.numel()
                host[offset:offset + n].view(t.shape).copy_(t.detach(), non_blocking=True)
                offset += n
        if done is not None:
            done.synchronize()
        return host.numpy().copy()

    def write(self, fragment: int, values: np.ndarray) -> None:
        """Overwrite the fragment with `values` (any float array of its size), in order
        before the training stream's next kernel; `values` may be reused at once."""
        numel = self.plan.fragments[fragment].numel
        if values.size != numel:
            raise ValueError(f"fragment {fragment} has {numel} elements, the values to "
                             f"write have {values.size}")
        host = self._idle_host(fragment)
        host.numpy()[:] = values.reshape(-1)
        with self._on_side_stream() as done, torch.no_grad():
            offset = 0
            for t in self._tensors[fragment]:
                n = t.numel()
                t.copy_(host[offset:offset + n].view(t.shape), non_blocking=True)
                offset += n
        if done is not None:
            torch.cuda.current_stream(self._cuda).wait_event(done)
            self._writing[fragment] = done

    def _idle_host(self, fragment: int) -> torch.Tensor:
        """The fragment's host buffer, once no copy out of it is in flight."""
        writing = self._writing[fragment]
        if writing is not None:
            writing.synchronize()
            self._writing[fragment] = None
        return self._host[fragment]

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[torch.cuda.Event | None]:
        """Copies issued inside run on the side stream after the training stream's work
        queued so far; the event yielded is recorded when they are done (None on CPU)."""
        if self._side is None:
            yield None
            return
        self._side.wait_stream(torch.cuda.current_stream(self._cuda))
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(self._side):
            yield done
            done.record(self._side)
