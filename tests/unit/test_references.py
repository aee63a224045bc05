"""coordinator.references: a learner that adds up the compressed deltas it is served holds
the coordinator's reference bit for bit, version after version and for every codec; the
error feedback keeps the reference within one compression step of the committed values;
a learner holding anything else gets the reference in fp32, and a lost version starts a
new chain."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from coordinator.references import AdvanceFailed, Encoded, References, Served, Step
from coordinator.store import Published
from protos.codec import BF16, E3M0, INT8, MIN_CHUNK_BYTES, Codec, add_delta

# Elements: two chunks and a part of one for int8 at the smallest chunk size.
NUMEL = (5 * MIN_CHUNK_BYTES) // 2 + 3
# Per codec, the largest error of one encoding relative to the chunk's max |x|
# (protos/codec.py: bf16 2^-8 |x|, int8 half a step of max/127, e3m0 (√2 - 1) |x|).
STEP = {"bf16": 2.0**-8, "int8": 0.5 / 127, "e3m0": 2**0.5 - 1}
codecs = pytest.mark.parametrize("codec", [BF16, INT8, E3M0], ids=lambda c: c.name)


def published(version: int, params: np.ndarray, commit_id: int | None = None) -> Published:
    params.flags.writeable = False  # the store never writes a published array again
    return Published(version, params, {}, time.monotonic(),
                     commit_id if commit_id is not None else 1000 + version)


def serve(references: References, fragment: int, codec: Codec, current: Published,
          have_reference: int) -> Served:
    """A pull's answer, `current` the fragment's newest version meanwhile."""
    return asyncio.run(references.serve(fragment, codec, have_reference, lambda: current))


def encoded(step: Step) -> list[Encoded]:
    """A step's chunks as a pull streams them, each awaited in turn. (Not the task's
    result: asyncio.run takes the repr of its task, whole megabytes of chunk bytes.)"""
    chunks: list[Encoded] = []

    async def stream() -> None:
        while (chunk := await step.chunk(len(chunks))) is not None:
            chunks.append(chunk)
    asyncio.run(stream())
    return chunks


def rebuilt(codec: Codec, held: np.ndarray, served: Served) -> np.ndarray:
    """What the learner computes from deltas: each one's chunks decoded, then added in
    fp32, in order."""
    assert served.deltas and served.values is None
    for step in served.deltas:
        decoded = np.empty_like(held)
        covered = 0
        for offset, count, scale, data in encoded(step):
            assert offset == covered
            codec.decode_into(data, scale, decoded[offset:offset + count])
            covered += count
        assert covered == held.size
        held = add_delta(held, decoded)
    return held


@codecs
def test_a_learner_adding_up_deltas_holds_the_reference_bit_for_bit(codec: Codec) -> None:
    references = References(MIN_CHUNK_BYTES)
    rng = np.random.default_rng(7)
    theta = rng.standard_normal(NUMEL).astype(np.float32)
    first = serve(references, 0, codec, published(0, theta.copy()), 0)
    assert first.values is not None and not first.deltas
    np.testing.assert_array_equal(first.values, theta)  # a chain starts from the values
    held, reference, delta_bytes = first.values, first.reference, 0
    for version in range(1, 21):
        theta = theta + (0.01 * rng.standard_normal(NUMEL)).astype(np.float32)
        gap = float(np.max(np.abs(theta - held)))
        current = published(version, theta.copy())
        served = serve(references, 0, codec, current, reference)
        held = rebuilt(codec, held, served)
        delta_bytes += sum(len(data) for step in served.deltas
                           for *_, data in encoded(step))
        # A learner holding nothing gets the reference itself: the same bits.
        fresh = serve(references, 0, codec, current, 0)
        assert fresh.reference == served.reference != reference
        assert fresh.values is not None
        np.testing.assert_array_equal(held.view(np.uint32), fresh.values.view(np.uint32))
        # Error feedback: one compression step of this version's gap, never a sum of them.
        assert float(np.max(np.abs(held - theta))) <= STEP[codec.name] * gap * 1.001 + 1e-30
        reference = served.reference
    assert delta_bytes == 20 * codec.encoded_bytes(NUMEL)


@codecs
def test_a_learner_holding_another_reference_gets_fp32(codec: Codec) -> None:
    references = References(MIN_CHUNK_BYTES)
    theta = np.linspace(-1, 1, NUMEL, dtype=np.float32)
    start = serve(references, 3, codec, published(4, theta.copy()), 0)
    advanced = published(5, theta * np.float32(1.5))
    for have_reference in (0, start.reference + 1):
        served = serve(references, 3, codec, advanced, have_reference)
        assert not served.deltas and served.values is not None
    assert serve(references, 3, codec, advanced, start.reference).deltas
    # The newest reference itself: nothing to add, so the values again.
    newest = serve(references, 3, codec, advanced, 0).reference
    assert serve(references, 3, codec, advanced, newest).values is not None


@pytest.mark.parametrize(("codec", "kept"), [(BF16, 1), (INT8, 3), (E3M0, 7)],
                         ids=lambda c: getattr(c, "name", str(c)))
def test_a_learner_some_versions_behind_gets_the_deltas_since_while_they_cost_less(
        codec: Codec, kept: int) -> None:
    references = References(MIN_CHUNK_BYTES)
    rng = np.random.default_rng(1)
    numel = 300_001  # one chunk: the chunking is the test above's
    theta = rng.standard_normal(numel).astype(np.float32)
    held: dict[int, tuple[int, np.ndarray]] = {}  # version -> (reference, values)
    first = serve(references, 0, codec, published(0, theta.copy()), 0)
    assert first.values is not None
    held[0] = (first.reference, first.values)
    for version in range(1, kept + 3):
        theta = theta + (0.01 * rng.standard_normal(numel)).astype(np.float32)
        current = published(version, theta.copy())
        fresh = serve(references, 0, codec, current, 0)  # advances the chain
        assert fresh.values is not None
        held[version] = (fresh.reference, fresh.values)
        for behind in range(1, version + 1):
            reference, values = held[version - behind]
            served = serve(references, 0, codec, current, reference)
            if behind <= kept:
                assert len(served.deltas) == behind
                np.testing.assert_array_equal(rebuilt(codec, values, served).view(np.uint32),
                                              fresh.values.view(np.uint32))
            else:  # more deltas than fp32 is worth
                assert not served.deltas and served.values is fresh.values


def test_each_fragment_and_codec_has_its_own_chain() -> None:
    references = References(MIN_CHUNK_BYTES)
    theta = np.ones(NUMEL, np.float32)
    ids = {serve(references, p, codec, published(0, theta.copy()), 0).reference
           for p in (0, 1) for codec in (INT8, E3M0)}
    assert len(ids) == 4


def test_versions_nobody_pulled_fold_into_one_delta() -> None:
    references = References(MIN_CHUNK_BYTES)
    theta = np.zeros(NUMEL, np.float32)
    start = serve(references, 0, INT8, published(2, theta.copy()), 0)
    assert start.values is not None
    later = np.full(NUMEL, 0.5, np.float32)
    served = serve(references, 0, INT8, published(6, later.copy()), start.reference)
    np.testing.assert_allclose(rebuilt(INT8, start.values, served), later, atol=0.5 / 127)


@pytest.mark.parametrize("lost", ["other commit", "coordinator behind"])
def test_a_lost_version_starts_a_new_chain(lost: str) -> None:
    references = References(MIN_CHUNK_BYTES)
    theta = np.ones(NUMEL, np.float32)
    serve(references, 0, INT8, published(0, theta.copy()), 0)
    old = serve(references, 0, INT8, published(1, theta * np.float32(2)), 0)
    again = (published(1, theta * np.float32(3), commit_id=77) if lost == "other commit"
             else published(0, theta * np.float32(3), commit_id=78))
    served = serve(references, 0, INT8, again, old.reference)
    assert served.reference != old.reference and served.values is not None
    np.testing.assert_array_equal(served.values, again.params)


class GatedInt8(type(INT8)):  # type: ignore[misc]
    """int8 whose encoder stops before chunk `stop_at` of each advance until released
    (or raises there, with `fail`): an advance caught in the middle."""

    def __init__(self, stop_at: int, fail: bool = False) -> None:
        self.stop_at, self.fail = stop_at, fail
        self.release = threading.Event()
        self.calls = 0

    def _encode(self, values: np.ndarray) -> tuple[bytes, float]:
        self.calls += 1
        if self.calls == self.stop_at + 1:
            if self.fail:
                raise MemoryError("no room for the chunk")
            assert self.release.wait(5), "the test never released the encoder"
        encoded: tuple[bytes, float] = super()._encode(values)
        return encoded


async def still_waiting(*tasks: asyncio.Future[Any]) -> bool:
    """Whether the tasks are all still waiting once they have had the chance to run.
    The encoder holds until the test releases it, so a task that waits for it cannot
    end first; one that does not wait ends well within the bound."""
    done, _ = await asyncio.wait(tasks, timeout=0.05)
    return not done


def gated_chain(fail: bool = False,
                ) -> tuple[References, GatedInt8, np.ndarray, np.ndarray, int]:
    """A chain at version 0 whose next advance holds (or fails) at its second chunk:
    the references, the codec, θ, the reference's values and its id."""
    references = References(MIN_CHUNK_BYTES)
    codec = GatedInt8(stop_at=1, fail=fail)
    theta = np.linspace(-1, 1, NUMEL, dtype=np.float32)
    start = serve(references, 0, codec, published(0, theta.copy()), 0)
    assert start.values is not None
    return references, codec, theta, start.values, start.reference


def test_a_delta_streams_its_chunks_while_the_rest_are_encoded() -> None:
    references, codec, theta, start_values, start_reference = gated_chain()
    first, second = (published(v, theta * np.float32(1 + v / 2)) for v in (1, 2))
    newest = first

    async def scenario() -> tuple[Served, Served]:
        nonlocal newest
        served = await references.serve(0, codec, start_reference, lambda: newest)
        (step,) = served.deltas
        assert await step.chunk(0) is not None  # the first chunk, while the rest is held
        assert await still_waiting(asyncio.ensure_future(step.chunk(1)))
        # A pull that finds the advance under way waits for it, then advances to the
        # newest version published meanwhile.
        newest = second
        later = asyncio.ensure_future(references.serve(0, codec, served.reference,
                                                       lambda: newest))
        assert await still_waiting(later)
        codec.release.set()
        return served, await later

    served, later = asyncio.run(scenario())
    assert served.published is first and later.published is second
    fresh = serve(references, 0, codec, second, 0)
    assert fresh.values is not None and fresh.reference == later.reference
    held = rebuilt(codec, rebuilt(codec, start_values, served), later)
    np.testing.assert_array_equal(held.view(np.uint32), fresh.values.view(np.uint32))


def test_versions_published_during_an_advance_fold_into_the_next() -> None:
    references, codec, theta, start_values, start_reference = gated_chain()
    versions = [published(v, theta * np.float32(1 + v)) for v in range(1, 6)]
    newest = versions[0]

    def latest() -> Published:
        return newest

    async def scenario() -> list[Served]:
        nonlocal newest
        first = await references.serve(0, codec, start_reference, latest)
        waiting = []
        for current in versions[1:]:  # four more versions while the first advance is held
            newest = current
            waiting.append(asyncio.ensure_future(
                references.serve(0, codec, first.reference, latest)))
        assert await still_waiting(*waiting)
        codec.release.set()
        return [first, *await asyncio.gather(*waiting)]

    first, *rest = asyncio.run(scenario())
    assert {served.published.version for served in rest} == {5}
    assert len({served.reference for served in rest}) == 1
    held = rebuilt(codec, rebuilt(codec, start_values, first), rest[0])
    # Two advances, not five: every pull that waited got the newest version's one.
    assert codec.calls == 2 * 3  # three chunks each
    fresh = serve(references, 0, codec, versions[-1], 0)
    assert fresh.values is not None
    np.testing.assert_array_equal(held.view(np.uint32), fresh.values.view(np.uint32))


def test_an_advance_that_fails_fails_its_pulls_and_the_chain_starts_again() -> None:
    references, codec, theta, _, start_reference = gated_chain(fail=True)
    current = published(1, theta * np.float32(1.5))
    served = serve(references, 0, codec, current, start_reference)
    (step,) = served.deltas
    assert asyncio.run(step.chunk(0)) is not None
    with pytest.raises(AdvanceFailed, match="no room for the chunk"):
        asyncio.run(step.chunk(1))
    again = serve(references, 0, codec, current, start_reference)
    assert again.values is not None and not again.deltas  # a new chain, from the values
    assert again.reference not in (start_reference, served.reference)
    np.testing.assert_array_equal(again.values, current.params)


def test_a_pull_answered_in_fp32_waits_for_the_whole_reference() -> None:
    references, codec, theta, start_values, start_reference = gated_chain()
    current = published(1, theta * np.float32(1.5))

    async def scenario() -> tuple[Served, Served]:
        served = await references.serve(0, codec, start_reference, lambda: current)
        fresh = asyncio.ensure_future(references.serve(0, codec, 0, lambda: current))
        assert await still_waiting(fresh)  # its values are still being written
        codec.release.set()
        return served, await fresh

    served, fresh = asyncio.run(scenario())
    assert fresh.values is not None and fresh.reference == served.reference
    held = rebuilt(codec, start_values, served)
    np.testing.assert_array_equal(held.view(np.uint32), fresh.values.view(np.uint32))


def test_a_pull_cancelled_while_it_waits_leaves_the_advance_to_the_others() -> None:
    references, codec, theta, start_values, start_reference = gated_chain()
    current = published(1, theta * np.float32(1.5))

    async def scenario() -> Served:
        served = await references.serve(0, codec, start_reference, lambda: current)
        (step,) = served.deltas
        waiting = asyncio.ensure_future(step.chunk(1))  # held at the second chunk
        assert await still_waiting(waiting)
        waiting.cancel()  # its learner went away
        with pytest.raises(asyncio.CancelledError):
            await waiting
        codec.release.set()
        return served

    served = asyncio.run(scenario())
    held = rebuilt(codec, start_values, served)  # another pull streams the whole delta
    fresh = serve(references, 0, codec, current, 0)
    assert fresh.values is not None and fresh.reference == served.reference
    np.testing.assert_array_equal(held.view(np.uint32), fresh.values.view(np.uint32))
