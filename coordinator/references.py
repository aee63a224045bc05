"""Compressed pulls: per fragment and codec, the reference that learners rebuild from deltas.

A pull in fp32 costs as many bytes as an fp32 push, so compressing only pushes saves at most
half of a round trip. A learner that pushes with a codec pulls with it too: the coordinator
keeps, per fragment and codec, a reference R (the values a learner holds after adding up the
compressed deltas served so far) and, when version u is published, serves it as
`D = decode(encode(Θ_u − R_v))`, then `R_u = R_v + D`. What `D` loses in compression is
still in `Θ − R`, so the next delta carries it (error feedback on the server's side) and the
gap stays one compression step however many versions pass. A learner that holds R_v (it
says so with the reference's id) adds the same `D` to it with the same fp32 addition and so
holds R_u bit for bit. A learner that holds an older reference of the chain gets the
deltas since, in order, while together they are smaller than fp32 (with several learners
and a quorum of one, versions pass between a learner's pulls); any other learner gets R_u
itself, in fp32, and can take deltas from then on.

A chain starts from the committed values themselves (no copy: published arrays are never
written) and advances on the first pull that finds a newer version; versions nobody pulled
in between fold into one delta. A chain whose version was lost (another commit id under its
number, or the coordinator behind it) starts again. Called by `coordinator.service` on the
pull path, in a worker thread: encoding a fragment is numpy work.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from coordinator.durability import new_commit_id
from coordinator.store import Published
from protos.codec import Codec, add_delta, chunk_elements

# One compressed chunk: offset and count in elements, scale, data.
Encoded = tuple[int, int, float, bytes]


@dataclass(frozen=True)
class Step:
    """One advance of a chain: the reference it went from, and the delta."""

    base_reference: int
    delta: tuple[Encoded, ...]


@dataclass(frozen=True)
class Served:
    """What one pull gets: the reference's values in fp32, or the deltas to add in
    order to the reference the learner holds (then `values` is None)."""

    reference: int
    values: np.ndarray | None
    deltas: tuple[Step, ...] = ()


@dataclass(frozen=True)
class _Chain:
    version: int
    commit_id: int
    reference: int
    values: np.ndarray
    # The latest advances, oldest first: as many as are smaller together than fp32.
    steps: tuple[Step, ...] = ()


class References:
    """Every fragment's reference chain for each codec learners pull with."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._chains: dict[tuple[int, str], _Chain] = {}
        self._locks: dict[tuple[int, str], threading.Lock] = {}
        self._guard = threading.Lock()

    def serve(self, fragment: int, codec: Codec, published: Published,
              have_reference: int) -> Served:
        """What a pull of `published` with `codec` gets, the learner holding the reference
        `have_reference` (0: none; its id names its version too). Blocking: run it in a
        thread."""
        key = (fragment, codec.name)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            chain = self._chains.get(key)
            if chain is None or _lost(chain, published):
                chain = _Chain(published.version, published.commit_id, new_commit_id(),
                               published.params)
            elif chain.version < published.version:
                chain = self._advance(chain, codec, published)
            self._chains[key] = chain
        for i, step in enumerate(chain.steps):
            if have_reference == step.base_reference:
                return Served(chain.reference, None, chain.steps[i:])
        return Served(chain.reference, chain.values)

    def _advance(self, chain: _Chain, codec: Codec, published: Published) -> _Chain:
        """The chain at `published`: the compressed change from its reference, and the
        reference plus that change decoded, as a learner computes it. Chunk by chunk
        through one chunk's scratch: the change of a whole fragment is never held, so
        each advance allocates only the new reference."""
        old, values = chain.values, np.empty_like(chain.values)
        step = chunk_elements(codec, self.chunk_bytes)
        scratch = np.empty(min(step, old.size), dtype=np.float32)
        delta = []
        for offset in range(0, old.size, step):
            end = min(offset + step, old.size)
            part = np.subtract(published.params[offset:end], old[offset:end],
                               out=scratch[:end - offset], dtype=np.float32)
            data, scale = codec.encode(part)
            codec.decode_into(data, scale, part)  # what the learner will decode
            add_delta(old[offset:end], part, out=values[offset:end])
            delta.append((offset, part.size, scale, data))
        # k deltas cost k·bits per element; beyond 32 bits fp32 is the cheaper answer.
        kept = max(1, 32 // codec.bits - 1)
        steps = (*chain.steps, Step(chain.reference, tuple(delta)))[-kept:]
        return _Chain(published.version, published.commit_id, new_commit_id(), values, steps)


def _lost(chain: _Chain, published: Published) -> bool:
    """The chain's version is not in the fragment's history as it now stands."""
    return (published.version < chain.version
            or (published.version == chain.version and published.commit_id != chain.commit_id))
