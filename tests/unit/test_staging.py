"""The coordinator's staging pool: a byte budget shared by concurrent pushes.
Room goes first to the learner holding the least of it, then in arrival order,
and every lease gives its bytes back and passes the room on, however its push
ends."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

from coordinator.store import StagingPool

BUDGET = 100  # elements
_LEARNERS = itertools.count()


def _pool() -> StagingPool:
    return StagingPool(budget_bytes=4 * BUDGET)


async def _hold(pool: StagingPool, numel: int, held: asyncio.Event,
                release: asyncio.Event | None = None, order: list[str] | None = None,
                name: str = "", learner: str = "") -> None:
    """One push: a lease of `numel` elements for `learner` (by default a learner of
    its own), held until `release` is set; it appends `name` to `order` once in."""
    async with pool.lease(learner or f"learner {next(_LEARNERS)}", numel) as lease:
        assert lease.buffer is not None and lease.buffer.size == numel
        if order is not None:
            order.append(name)
        held.set()
        await (release or asyncio.Event()).wait()


async def _settle() -> None:
    """Let every ready task run to its next wait: asyncio runs them in turn, each
    new push reaching its lease (or its place in the queue) within a turn or two."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_room_goes_to_waiting_pushes_in_arrival_order() -> None:
    async def scenario() -> None:
        pool = _pool()
        first_held, release_first = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(_hold(pool, BUDGET, first_held, release_first))
        await first_held.wait()
        order: list[str] = []
        releases = [asyncio.Event() for _ in range(8)]
        waiters = [asyncio.create_task(_hold(pool, BUDGET, asyncio.Event(), releases[i],
                                             order, str(i)))
                   for i in range(8)]
        await _settle()
        release_first.set()
        for i in range(8):  # each holds the whole budget until let go
            await _settle()
            assert order == [str(k) for k in range(i + 1)]
            releases[i].set()
        await asyncio.gather(first, *waiters)
        assert pool.in_use == 0

    asyncio.run(scenario())


def test_a_small_push_arriving_while_a_large_one_waits_queues_behind_it() -> None:
    """The large fragment (over the whole budget) needs the pool empty; small
    pushes arriving meanwhile must not keep it from ever being empty."""
    async def scenario() -> None:
        pool = _pool()
        small_held, release_small = asyncio.Event(), asyncio.Event()
        small = asyncio.create_task(_hold(pool, 10, small_held, release_small))
        await small_held.wait()
        order: list[str] = []
        large_held, release_large = asyncio.Event(), asyncio.Event()
        large = asyncio.create_task(_hold(pool, 3 * BUDGET, large_held, release_large,
                                          order, "large"))
        await _settle()
        later_held = asyncio.Event()
        later = asyncio.create_task(_hold(pool, 10, later_held, None, order, "later"))
        await _settle()
        assert not large_held.is_set() and not later_held.is_set()  # room, but it queues
        release_small.set()
        await asyncio.wait_for(large_held.wait(), 5)
        assert pool.in_use == 4 * 3 * BUDGET and not later_held.is_set()  # alone
        release_large.set()
        await asyncio.wait_for(later_held.wait(), 5)
        assert order == ["large", "later"]
        later.cancel()
        await asyncio.gather(small, large, later, return_exceptions=True)
        assert pool.in_use == 0

    asyncio.run(scenario())


def test_a_push_cancelled_while_waiting_takes_nothing_and_unblocks_those_behind() -> None:
    async def scenario() -> None:
        pool = _pool()
        first_held, release_first = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(_hold(pool, 80, first_held, release_first))
        await first_held.wait()
        big = asyncio.create_task(_hold(pool, 80, asyncio.Event()))  # does not fit yet
        await _settle()
        behind_held = asyncio.Event()
        behind = asyncio.create_task(_hold(pool, 20, behind_held))  # fits, but queued
        await _settle()
        assert not behind_held.is_set()
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)
        await asyncio.wait_for(behind_held.wait(), 5)
        assert pool.in_use == 4 * (80 + 20)
        release_first.set()
        behind.cancel()
        await asyncio.gather(first, behind, return_exceptions=True)
        assert pool.in_use == 0

    asyncio.run(scenario())


def test_a_push_granted_room_and_cancelled_before_it_runs_passes_the_room_on() -> None:
    async def scenario() -> None:
        pool = _pool()
        first = pool.lease("first", BUDGET)
        await first.__aenter__()
        granted_held, next_held = asyncio.Event(), asyncio.Event()
        granted = asyncio.create_task(_hold(pool, BUDGET, granted_held))
        after = asyncio.create_task(_hold(pool, BUDGET, next_held))
        await _settle()
        await first.__aexit__(None, None, None)  # grants `granted` the room, awaiting nothing
        assert pool.in_use == 4 * BUDGET
        granted.cancel()  # before it ever ran with its room
        await asyncio.gather(granted, return_exceptions=True)
        assert not granted_held.is_set()
        await asyncio.wait_for(next_held.wait(), 5)
        assert pool.in_use == 4 * BUDGET
        after.cancel()
        await asyncio.gather(after, return_exceptions=True)
        assert pool.in_use == 0

    asyncio.run(scenario())


def test_a_lease_ends_and_grants_the_next_without_giving_the_loop_a_turn() -> None:
    """A push whose stream ends short leaves its lease and goes on to count the
    cut (`Engine.wait_out_cut`); a suspension on the way out would let gRPC's
    cancellation land there instead, and the cut would go uncounted."""
    async def scenario() -> None:
        pool = _pool()
        waiter_held = asyncio.Event()
        turns = 0

        async def count_turns() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        counter = asyncio.create_task(count_turns())
        waiter: asyncio.Task[None] | None = None
        with contextlib.suppress(ValueError):
            async with pool.lease("cut", BUDGET):
                waiter = asyncio.create_task(_hold(pool, BUDGET, waiter_held))
                await _settle()  # queued behind this lease
                before = turns
                raise ValueError("stream ended short")
        assert turns == before  # left, and the room granted, in one go
        assert pool.in_use == 4 * BUDGET  # now the waiter's
        await asyncio.wait_for(waiter_held.wait(), 5)
        assert waiter is not None
        for task in (waiter, counter):
            task.cancel()
        await asyncio.gather(waiter, counter, return_exceptions=True)
        assert pool.in_use == 0

    asyncio.run(scenario())


class _Pushes:
    """Named pushes of half the budget each, by the learner their name starts with
    ("a1" is learner a's), each held until `release(name)`."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool = pool
        self.order: list[str] = []
        self._held: dict[str, asyncio.Event] = {}
        self._releases: dict[str, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, *names: str) -> None:
        """Start each push in turn, each reaching its lease or its place in the queue."""
        for name in names:
            self._held[name], self._releases[name] = asyncio.Event(), asyncio.Event()
            self._tasks.append(asyncio.create_task(_hold(
                self.pool, BUDGET // 2, self._held[name], self._releases[name], self.order,
                name, learner=name[0])))
            await _settle()

    async def release(self, name: str) -> None:
        self._releases[name].set()
        await _settle()

    async def finish(self) -> None:
        for release in self._releases.values():
            release.set()
        await asyncio.gather(*self._tasks)
        assert self.pool.in_use == 0
        assert all(self.pool.held(name[0]) == 0 for name in self._held)


def test_a_learner_with_a_push_in_staging_waits_behind_other_learners_first_pushes() -> None:
    """a's second and third pushes came first, but a already holds staging: c's and
    d's first pushes, arriving later, get the room that frees before them."""
    async def scenario() -> None:
        pushes = _Pushes(_pool())
        await pushes.start("a1", "b1", "a2", "a3", "c1", "d1")
        assert pushes.order == ["a1", "b1"]  # the pool is full
        assert pushes.pool.held("a") == 4 * BUDGET // 2
        await pushes.release("b1")
        assert pushes.order == ["a1", "b1", "c1"]
        await pushes.release("c1")
        assert pushes.order == ["a1", "b1", "c1", "d1"]
        await pushes.release("d1")  # only a waits now
        assert pushes.order == ["a1", "b1", "c1", "d1", "a2"]
        await pushes.release("a1")
        assert pushes.order == ["a1", "b1", "c1", "d1", "a2", "a3"]
        await pushes.finish()

    asyncio.run(scenario())


def test_room_freed_alternates_between_a_learner_pushing_many_and_one_waiting() -> None:
    """a pushes four fragments at once into a pool that takes two; once b waits
    too, freed room alternates between them instead of going to a's queue first."""
    async def scenario() -> None:
        pushes = _Pushes(_pool())
        await pushes.start("a1", "a2", "a3", "a4", "b1", "b2")
        assert pushes.order == ["a1", "a2"]  # nobody else waited: a may take it all
        for name, next_in in (("a1", "b1"), ("a2", "a3"), ("b1", "b2"), ("a3", "a4")):
            await pushes.release(name)
            assert pushes.order[-1] == next_in, pushes.order
            assert abs(pushes.pool.held("a") - pushes.pool.held("b")) <= 4 * BUDGET // 2
        assert pushes.order == ["a1", "a2", "b1", "a3", "b2", "a4"]
        await pushes.finish()

    asyncio.run(scenario())


def test_a_first_push_that_fits_is_let_in_past_one_waiting_for_more_room() -> None:
    """a's second push waits for room it needs; b's first needs less, fits, and
    holds less than a does, so it goes in at once rather than queueing behind."""
    async def scenario() -> None:
        pool = _pool()
        a_held, release_a = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(_hold(pool, 60, a_held, release_a, learner="a"))
        await a_held.wait()
        order: list[str] = []
        second = asyncio.create_task(_hold(pool, 60, asyncio.Event(), None, order, "a2",
                                           learner="a"))
        await _settle()
        b_held, release_b = asyncio.Event(), asyncio.Event()
        b = asyncio.create_task(_hold(pool, 30, b_held, release_b, order, "b1", learner="b"))
        await asyncio.wait_for(b_held.wait(), 5)
        assert order == ["b1"] and pool.in_use == 4 * (60 + 30)
        release_a.set()  # now a holds nothing, and its waiting push fits
        await _settle()
        assert order == ["b1", "a2"]
        release_b.set()
        second.cancel()
        await asyncio.gather(first, second, b, return_exceptions=True)
        assert pool.in_use == 0 and pool.held("a") == pool.held("b") == 0

    asyncio.run(scenario())
