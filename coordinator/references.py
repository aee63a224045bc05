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
encoding overlaps the link instead of preceding it. A fragment and codec have one advance
under way at a time: pulls that find one wait for it, and then the versions published
meanwhile fold into the next. Called by `coordinator.service` on the pull path, on the
event loop: deciding is quick, the encoding is the advance's thread's, and pulls wait for
it without holding a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coordinator.durability import new_commit_id
from coordinator.store import Published
from protos.codec import Codec, add_delta, chunk_elements

# One compressed chunk: offset and count in elements, scale, data.
Encoded = tuple[int, int, float, bytes]


class AdvanceFailed(RuntimeError):
    """The advance a pull was streaming from stopped (its encoding failed): the pull is
    cut, its learner pulls again, and that pull starts the chain again."""


class Step:
    """One advance of a chain: the reference it went from, and the delta's chunks as its
    thread encodes them, oldest first."""

    def __init__(self, base_reference: int) -> None:
        self.base_reference = base_reference
        self._chunks: list[Encoded] = []
        self._complete = False
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        # Pulls waiting on their event loop, woken from the advance's thread: a waiting
        # pull holds no worker thread, however many learners pull.
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def done(self) -> bool:
        """The advance has finished or failed."""
        with self._lock:
            return self._ended()

    async def chunk(self, index: int) -> Encoded | None:
        """Chunk `index` of the delta, waiting while it is encoded; None past the last."""
        while True:
            with self._lock:
                if index < len(self._chunks):
                    return self._chunks[index]
                if self._failure is not None:
                    raise AdvanceFailed(f"the reference's advance stopped: "
                                        f"{self._failure!r}") from self._failure
                if self._complete:
                    return None
                woken = self._woken()
            await woken

    async def finished(self) -> bool:
        """Until the advance is done: True when the reference it writes is whole, False
        when it failed."""
        while True:
            with self._lock:
                if self._ended():
                    return self._complete
                woken = self._woken()
            await woken

    def _ended(self) -> bool:
        return self._complete or self._failure is not None  # hold the lock

    def _woken(self) -> asyncio.Future[None]:
        """A future the advance's thread resolves at its next chunk or its end (hold
        the lock)."""
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        self._waiting.append((loop, woken))
        return woken

    def _add(self, chunk: Encoded) -> None:
        with self._lock:
            self._chunks.append(chunk)
            self._wake_all()

    def _finish(self, failure: BaseException | None = None) -> None:
        with self._lock:
            self._complete, self._failure = failure is None, failure
            self._wake_all()

    def _wake_all(self) -> None:
        waiting, self._waiting = self._waiting, []
        for loop, woken in waiting:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
                loop.call_soon_threadsafe(_wake, woken)


@dataclass(frozen=True)
class Served:
    """What one pull gets: the reference's values in fp32, or the deltas to add in
    order to the reference the learner holds (then `values` is None), at `published`."""

    published: Published
    reference: int
    values: np.ndarray | None
    deltas: tuple[Step, ...] = ()


@dataclass(frozen=True)
class _Chain:
    # The version and commit id only: holding its `Published` would keep that version's
    # values alive past its successor's publication, a fragment-sized array each.
    version: int
    commit_id: int
    reference: int
    # Written by `filling`'s thread until it completes; never again after.
    values: np.ndarray
    # The latest advances, oldest first: as many as are smaller together than fp32.
    steps: tuple[Step, ...] = ()

    @property
    def filling(self) -> Step | None:
        """The advance that writes `values`: the newest step (None for a chain that
        starts from the committed values, which has none)."""
        return self.steps[-1] if self.steps else None


class References:
    """Every fragment's reference chain for each codec learners pull with."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._chains: dict[tuple[int, str], _Chain] = {}
        # Between the event loop, which serves, and an advance's thread that fails.
        self._guard = threading.Lock()

    async def serve(self, fragment: int, codec: Codec, have_reference: int,
                    latest: Callable[[], Published]) -> Served:
        """What a pull with `codec` gets of `latest()` (the fragment's newest version),
        the learner holding the reference `have_reference` (0: none; its id names its
        version too). Deltas may still be encoding (`Step.chunk` awaits each); fp32
        values are whole.

        One advance per fragment and codec at a time: a pull that finds one under way
        waits for it, then advances to the newest version then, so the versions
        published while an advance encodes fold into the next one instead of queueing
        an advance each."""
        key = (fragment, codec.name)
        while True:
            published = latest()
            with self._guard:
                chain = self._chains.get(key)
                if chain is None or _lost(chain, published):
                    chain = _Chain(published.version, published.commit_id, new_commit_id(),
                                   published.params)
                    self._chains[key] = chain
                elif chain.version < published.version and (
                        chain.filling is None or chain.filling.done):
                    chain = self._advance(key, chain, codec, published)
                    self._chains[key] = chain
            if chain.version < published.version:
                assert chain.filling is not None
                await chain.filling.finished()
                continue
            for i, step in enumerate(chain.steps):
                if have_reference == step.base_reference:
                    return Served(published, chain.reference, None, chain.steps[i:])
            if chain.filling is None or await chain.filling.finished():
                return Served(published, chain.reference, chain.values)
            # Its advance failed and took the chain with it: start the chain again.

    def _advance(self, key: tuple[int, str], chain: _Chain, codec: Codec,
                 published: Published) -> _Chain:
        """The chain at `published`, its delta and reference filled in by a thread of its
        own (`_fill`)."""
        step = Step(chain.reference)
        # k deltas cost k·bits per element; beyond 32 bits fp32 is the cheaper answer.
        kept = max(1, 32 // codec.bits - 1)
        advanced = _Chain(published.version, published.commit_id, new_commit_id(),
                          np.empty_like(chain.values), (*chain.steps, step)[-kept:])
        threading.Thread(target=self._fill, args=(key, chain, advanced, codec, published),
                         name=f"reference-{key[0]}-{key[1]}", daemon=True).start()
        return advanced

    def _fill(self, key: tuple[int, str], chain: _Chain, advanced: _Chain, codec: Codec,
              published: Published) -> None:
        """The compressed change from `chain`'s reference (whole: one advance at a time)
        to `advanced`'s version, and the reference plus that change decoded, as a
        learner computes it. Chunk by chunk through one chunk's scratch: the change of
        a whole fragment is never held, and each chunk is served as soon as it is
        encoded."""
        step = advanced.filling
        assert step is not None
        old, values, new = chain.values, advanced.values, published.params
        try:
            size = chunk_elements(codec, self.chunk_bytes)
            scratch = np.empty(min(size, old.size), dtype=np.float32)
            for offset in range(0, old.size, size):
                end = min(offset + size, old.size)
                part = np.subtract(new[offset:end], old[offset:end],
                                   out=scratch[:end - offset], dtype=np.float32)
                data, scale = codec.encode(part)
                codec.decode_into(data, scale, part)  # what the learner will decode
                add_delta(old[offset:end], part, out=values[offset:end])
                step._add((offset, part.size, scale, data))
        except BaseException as exc:
            with self._guard:
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
