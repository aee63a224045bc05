"""The fragment store: global fp32 fragments, outer-optimizer state, open-round
accumulators and the staging memory that pushes stream into.

Memory stays flat in the number of learners: per fragment the daemon holds
the published parameters, the momentum and one accumulator, plus a fixed
budget of staging buffers that concurrent pushes share (a push waits for
room rather than allocating). Published parameter arrays are never written
again; a commit builds the next version in the accumulator's buffer and
swaps it in, so a pull streaming the old version is never torn.

A commit may pass a guard, awaited after the version is durable and before
it is published: high availability replicates the version there and checks
that this replica still leads; a guard that raises leaves the version
unpublished. Called by `coordinator.engine`; heavy numpy work runs in
worker threads.

Each fold is a span under the push's admit span, and each commit a round
span linking to the admit spans of every contribution it merges (one round
merges many traces), with the merge, outer step, durable write, replication
and publish under it; the published version keeps the round span's context,
so a learner's apply span can link to the commit.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import SpanContext

from coordinator.config import OuterConfig
from coordinator.durability import (
    FragmentRecord,
    Regression,
    StateDir,
    StateError,
    new_commit_id,
)
from coordinator.merge import Accumulator, norm_sq, outer_step
from coordinator.policy import MergeRule, RoundClose
from protos import telemetry

# Awaited with each durable record before it is published; raises to stop that.
Guard = Callable[[FragmentRecord], Awaitable[None]]

_TRACER = trace.get_tracer(__name__)


@dataclass(frozen=True)
class Published:
    """One committed, durable version of a fragment; immutable."""

    version: int
    params: np.ndarray
    watermarks: dict[str, int]
    committed_at: float
    commit_id: int
    # The round span that committed it (None for version 0 or when not tracing).
    trace: SpanContext | None = None
    # Σ Δ² of the merged outer gradient it applied, where the policy asks for it to
    # estimate gradient noise (`Policy.record_merge`); NaN otherwise.
    merged_norm_sq: float = math.nan
    # Wall time of its publication: the commit event's time, which the harness orders
    # epochs by, even when the process stops before it logs the commit.
    published_t: float = field(default_factory=time.time)


@dataclass
class _Slot:
    numel: int
    rule: MergeRule
    published: Published | None = None
    momentum: np.ndarray | None = None
    accumulator: Accumulator = field(init=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    commits: int = 0
    merged: int = 0
    # The admit spans of the contributions folded into the open round.
    admits: list[SpanContext] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accumulator = Accumulator(self.rule)


@dataclass
class Lease:
    """A staging buffer lent to one push; `buffer` is None once the store kept it."""

    buffer: np.ndarray | None


class StagingPool:
    """A byte budget for fragment-sized staging buffers, shared by all pushes.

    Room goes first to the waiting push whose learner holds the least staging,
    and among those in arrival order. So a learner with a push in staging waits
    behind other learners' first pushes, and no learner gets room ahead of a
    waiting one that holds less: one learner pushing many fragments at once (or
    one whose pushes are stuck) cannot take the budget from the rest as it frees,
    and a large fragment is not starved by a stream of small ones. Nothing on
    the way out awaits, so a push cancelled as it ends cannot keep its bytes or
    fail to pass the room on."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.in_use = 0
        self._free: dict[int, list[np.ndarray]] = {}
        # Bytes each learner's leases hold now; learners holding none are absent.
        self._held: dict[str, int] = {}
        # Waiting pushes in arrival order (dicts keep it): each one's grant, learner
        # and bytes.
        self._waiting: dict[asyncio.Future[None], tuple[str, int]] = {}

    def held(self, learner: str) -> int:
        """Bytes of staging `learner`'s pushes hold now."""
        return self._held.get(learner, 0)

    @asynccontextmanager
    async def lease(self, learner: str, numel: int) -> AsyncIterator[Lease]:
        """A float32 buffer of `numel` elements for one of `learner`'s pushes;
        waits for room and for its turn."""
        nbytes = 4 * numel
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[granted] = (learner, nbytes)
        self._grant()  # at once, without a suspension, when it is next and fits
        try:
            await granted
        except asyncio.CancelledError:
            if self._waiting.pop(granted, None) is None and not granted.cancelled():
                self._release(learner, nbytes)  # granted just as it was cancelled
            self._grant()  # those queued behind it may fit now
            raise
        lease = Lease(None)
        try:
            lease.buffer = self._take(numel)
            yield lease
        finally:
            if lease.buffer is not None:
                self._free.setdefault(numel, []).append(lease.buffer)
            self._release(learner, nbytes)
            self._grant()

    def _fits(self, nbytes: int) -> bool:
        # A fragment larger than the whole budget still gets in, alone.
        return self.in_use == 0 or self.in_use + nbytes <= self.budget

    def _hold(self, learner: str, nbytes: int) -> None:
        self.in_use += nbytes
        self._held[learner] = self._held.get(learner, 0) + nbytes

    def _release(self, learner: str, nbytes: int) -> None:
        self.in_use -= nbytes
        left = self._held.pop(learner) - nbytes
        if left:
            self._held[learner] = left

    def _grant(self) -> None:
        """Lease room to waiting pushes, the next one first, while the next fits."""
        while self._waiting:
            for waiter in [w for w in self._waiting if w.cancelled()]:
                del self._waiting[waiter]  # its task has yet to run and leave the queue
            if not self._waiting:
                return
            # min() keeps the first of equals: arrival order among equal holders.
            waiter = min(self._waiting, key=lambda w: self.held(self._waiting[w][0]))
            learner, nbytes = self._waiting[waiter]
            if not self._fits(nbytes):
                return
            del self._waiting[waiter]
            self._hold(learner, nbytes)
            waiter.set_result(None)

    def _take(self, numel: int) -> np.ndarray:
        free = self._free.get(numel)
        return free.pop() if free else np.empty(numel, dtype=np.float32)


class FragmentStore:
    """Every fragment of the run, with durability and long-poll notification."""

    def __init__(self, state: StateDir, outer: OuterConfig, rule: MergeRule,
                 numels: tuple[int, ...], staging_bytes: int) -> None:
        self.state = state
        self.outer = outer
        self.slots = [_Slot(numel=n, rule=rule) for n in numels]
        largest = 4 * max(numels, default=0)
        self.staging = StagingPool(staging_bytes or 2 * largest)
        self.bytes_written = 0

    def resume(self) -> tuple[dict[int, FragmentRecord], list[Regression]]:
        """Load every fragment's last durable version; returns what was found, and
        the fragments found older than the manifest log says they were."""
        found: dict[int, FragmentRecord] = {}
        for p, slot in enumerate(self.slots):
            record = self.state.load_fragment(p)
            if record is None:
                continue
            if record.params.size != slot.numel:
                raise StateError(f"fragment {p} on disk has {record.params.size} elements, "
                                 f"the run's layout says {slot.numel}")
            if self.outer.momentum == 0 and not record.zero_momentum:
                # A run with momentum left this buffer: without momentum it stays zero
                # from here on (`outer_step` leaves it, and commits say it is zero). The
                # file keeps it until the fragment's next commit.
                record.momentum.fill(0)
                record.zero_momentum = True
            slot.momentum = record.momentum
            slot.published = Published(record.version, record.params, record.watermarks,
                                       time.monotonic(), record.commit_id)
            found[p] = record
        regressions = self.state.restore_manifests([found.get(p) for p in range(len(self.slots))])
        return found, regressions

    def published(self, fragment: int) -> Published | None:
        return self.slots[fragment].published

    def snapshot(self) -> list[Published | None]:
        """A consistent vector of published versions (taken in one loop step)."""
        return [slot.published for slot in self.slots]

    def lock(self, fragment: int) -> asyncio.Lock:
        return self.slots[fragment].lock

    def numel(self, fragment: int) -> int:
        return self.slots[fragment].numel

    def stats(self, fragment: int) -> tuple[int, int]:
        """(commits, merged contributions) since start."""
        slot = self.slots[fragment]
        return slot.commits, slot.merged

    async def initialize(self, fragment: int, values: np.ndarray, watermarks: dict[str, int],
                         epoch: int = 0, guard: Guard | None = None) -> Published:
        """Make `values` (owned by the store from now on) version 0. Hold the lock."""
        slot = self.slots[fragment]
        momentum = np.zeros(slot.numel, dtype=np.float32)
        record = FragmentRecord(fragment, 0, values, momentum, watermarks, [], epoch,
                                new_commit_id(), zero_momentum=True)
        self.bytes_written += await asyncio.to_thread(self.state.save_fragment, record)
        if guard is not None:
            await guard(record)
        slot.momentum = momentum
        return await self._publish(
            slot, Published(0, values, watermarks, time.monotonic(), record.commit_id))

    async def fold(self, fragment: int, values: np.ndarray, weight: float, norm: float,
                   prescaled: float) -> np.ndarray | None:
        """Fold a complete, validated contribution (`prescaled · v`) into the open
        round. Hold the lock. Returns the staging buffer if it can go back to the pool."""
        slot = self.slots[fragment]
        admit = trace.get_current_span().get_span_context()
        with _TRACER.start_as_current_span("ftsync.fold", attributes={
                "ftsync.fragment": fragment, "ftsync.weight": weight, "ftsync.norm": norm}):
            spare = await asyncio.to_thread(slot.accumulator.fold, values, weight, norm,
                                            prescaled)
        if admit.is_valid:
            slot.admits.append(admit)
        slot.merged += 1
        return spare

    async def commit(self, close: RoundClose, manifest: list[dict[str, Any]], epoch: int = 0,
                     guard: Guard | None = None) -> Published:
        """Merge the closed round, step the outer optimizer, write, publish. Hold the lock."""
        slot = self.slots[close.fragment]
        old = slot.published
        assert old is not None and slot.momentum is not None
        accumulator, slot.accumulator = slot.accumulator, Accumulator(slot.rule)
        admits, slot.admits = slot.admits, []
        watermarks = dict(old.watermarks)
        for c in close.manifest:
            watermarks[c.id.learner_id] = max(watermarks.get(c.id.learner_id, 0), c.id.seq)
        momentum = slot.momentum

        def merge_and_write() -> tuple[FragmentRecord, int, float]:
            with _TRACER.start_as_current_span("ftsync.merge"):
                delta = accumulator.result(close.total_weight)
                merged_sq = norm_sq(delta) if close.choice is not None else math.nan
            with _TRACER.start_as_current_span("ftsync.outer_step"):
                params = outer_step(self.outer.scaled(close.step_scale), old.params,
                                    momentum, delta)
            record = FragmentRecord(close.fragment, close.version, params, momentum,
                                    watermarks, manifest, epoch, new_commit_id(),
                                    zero_momentum=self.outer.momentum == 0)
            with _TRACER.start_as_current_span("ftsync.durable_write") as write:
                written = self.state.save_fragment(record)
                write.set_attribute("ftsync.bytes", written)
            return record, written, merged_sq

        with _TRACER.start_as_current_span("ftsync.round_close", links=telemetry.links(admits),
                                           attributes=_round_attributes(close)) as span:
            record, written, merged_sq = await asyncio.to_thread(merge_and_write)
            self.bytes_written += written
            if guard is not None:
                with _TRACER.start_as_current_span("ftsync.replicate"):
                    await guard(record)
            params = record.params
            slot.commits += 1
            round_span = span.get_span_context()
            with _TRACER.start_as_current_span("ftsync.publish"):
                return await self._publish(
                    slot, Published(close.version, params, watermarks, time.monotonic(),
                                    record.commit_id,
                                    round_span if round_span.is_valid else None, merged_sq))

    async def wait_newer(self, fragment: int, have_version: int,
                         timeout: float) -> Published | None:
        """The published version if newer than `have_version`, waiting up to `timeout`."""
        slot = self.slots[fragment]

        def newer() -> bool:
            return slot.published is not None and slot.published.version > have_version

        async with slot.changed:
            if not newer():
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel
                # that arrives as the version does, and the cancelled pull goes on.
                try:
                    async with asyncio.timeout(timeout):
                        await slot.changed.wait_for(newer)
                except TimeoutError:
                    return None
        return slot.published

    async def _publish(self, slot: _Slot, published: Published) -> Published:
        slot.published = published
        async with slot.changed:
            slot.changed.notify_all()
        return published


def _round_attributes(close: RoundClose) -> dict[str, Any]:
    return {"ftsync.fragment": close.fragment, "ftsync.version": close.version,
            "ftsync.round.why": close.why, "ftsync.round.contributions": len(close.manifest),
            "ftsync.round.learners": len({c.id.learner_id for c in close.manifest}),
            "ftsync.round.quorum_wait_s": close.quorum_at - close.opened_at,
            "ftsync.round.grace_s": close.grace_s, "ftsync.round.step_scale": close.step_scale}
