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
number, or the coordinator behind it) starts again. An advance runs in a thread of its own
and hands out each delta chunk as it is encoded: the pull that started it, and any other
pull of the same step, streams the chunks done while the rest are encoded, so the change's
encoding overlaps the link instead of preceding it. Called by `coordinator.service` on the
pull path, in a worker thread: deciding is quick, and only a pull answered with the
reference's fp32 values waits for the advance to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass

import numpy as np

from coordinator.durability import new_commit_id
from coordinator.store import Published
from protos.codec import Codec, add_delta, chunk_elements

# One compressed chunk: offset and count in elements, scale, data.
Encoded = tuple[int, int, float, bytes]


class AdvanceFailed(RuntimeError):
    """The advance a pull was streaming from stopped; the chain starts again at the next
    pull, and this one fails (its learner pulls again)."""


class Step:
    """One advance of a chain: the reference it went from, and the delta's chunks as its
    thread encodes them, oldest first."""

    def __init__(self, base_reference: int) -> None:
        self.base_reference = base_reference
        self._chunks: list[Encoded] = []
        self._complete = False
        self._failure: BaseException | None = None
        self._changed = threading.Condition()
        # Pulls waiting on their event loop for the next chunk, woken from the advance's
        # thread: a waiting pull holds no worker thread, however many learners pull.
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    async def chunk(self, index: int) -> Encoded | None:
        """Chunk `index` of the delta, waiting while it is encoded; None past the last."""
        loop = asyncio.get_running_loop()
        while True:
            with self._changed:
                if index < len(self._chunks):
                    return self._chunks[index]
                self._raise_failure()
                if self._complete:
                    return None
                woken = loop.create_future()
                self._waiting.append((loop, woken))
            await woken

    def wait(self) -> None:
        """Until the advance is done, so the reference it writes is whole (blocking)."""
        with self._changed:
            self._changed.wait_for(lambda: self._complete or self._failure is not None)
            self._raise_failure()

    def _add(self, chunk: Encoded) -> None:
        with self._changed:
            self._chunks.append(chunk)
            self._wake_all()

    def _finish(self, failure: BaseException | None = None) -> None:
        with self._changed:
            self._complete, self._failure = failure is None, failure
            self._wake_all()

    def _wake_all(self) -> None:
        self._changed.notify_all()
        waiting, self._waiting = self._waiting, []
        for loop, woken in waiting:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
                loop.call_soon_threadsafe(_wake, woken)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise AdvanceFailed(f"the reference's advance stopped: {self._failure!r}") \
                from self._failure


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
    # Written by `filling`'s thread until it completes; never again after.
    values: np.ndarray
    # The latest advances, oldest first: as many as are smaller together than fp32.
    steps: tuple[Step, ...] = ()
    filling: Step | None = None


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
        `have_reference` (0: none; its id names its version too). Deltas may still be
        encoding (`Step.chunk` awaits each); fp32 values are whole. Blocking: run it in
        a thread."""
        key = (fragment, codec.name)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            chain = self._chains.get(key)
            if chain is None or _lost(chain, published):
                chain = _Chain(published.version, published.commit_id, new_commit_id(),
                               published.params)
            elif chain.version < published.version:
                chain = self._advance(key, lock, chain, codec, published)
            self._chains[key] = chain
        for i, step in enumerate(chain.steps):
            if have_reference == step.base_reference:
                return Served(chain.reference, None, chain.steps[i:])
        if chain.filling is not None:
            chain.filling.wait()
        return Served(chain.reference, chain.values)

    def _advance(self, key: tuple[int, str], lock: threading.Lock, chain: _Chain,
                 codec: Codec, published: Published) -> _Chain:
        """The chain at `published`, its delta and reference filled in by a thread of its
        own (`_fill`)."""
        step = Step(chain.reference)
        # k deltas cost k·bits per element; beyond 32 bits fp32 is the cheaper answer.
        kept = max(1, 32 // codec.bits - 1)
        advanced = _Chain(published.version, published.commit_id, new_commit_id(),
                          np.empty_like(chain.values), (*chain.steps, step)[-kept:], step)
        threading.Thread(target=self._fill, args=(key, lock, chain, advanced, codec, published),
                         name=f"reference-{key[0]}-{key[1]}", daemon=True).start()
        return advanced

    def _fill(self, key: tuple[int, str], lock: threading.Lock, chain: _Chain,
              advanced: _Chain, codec: Codec, published: Published) -> None:
        """The compressed change from `chain`'s reference to `published`, and the
        reference plus that change decoded, as a learner computes it. Chunk by chunk
        through one chunk's scratch: the change of a whole fragment is never held, and
        each chunk is served as soon as it is encoded."""
        step = advanced.filling
        assert step is not None
        try:
            if chain.filling is not None:
                chain.filling.wait()  # the reference this one starts from
            old, values = chain.values, advanced.values
            size = chunk_elements(codec, self.chunk_bytes)
            scratch = np.empty(min(size, old.size), dtype=np.float32)
            for offset in range(0, old.size, size):
                end = min(offset + size, old.size)
                part = np.subtract(published.params[offset:end], old[offset:end],
                                   out=scratch[:end - offset], dtype=np.float32)
                data, scale = codec.encode(part)
                codec.decode_into(data, scale, part)  # what the learner will decode
                add_delta(old[offset:end], part, out=values[offset:end])
                step._add((offset, part.size, scale, data))
        except BaseException as exc:
            with lock:
                if self._chains.get(key) is advanced:
                    del self._chains[key]  # the next pull starts the chain again
            step._finish(exc)  # each pull streaming it fails with it
            return
        step._finish()


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():  # a pull cancelled while it waited leaves its future cancelled
        woken.set_result(None)


def _lost(chain: _Chain, published: Published) -> bool:
    """The chain's version is not in the fragment's history as it now stands."""
    return (published.version < chain.version
            or (published.version == chain.version and published.commit_id != chain.commit_id))
