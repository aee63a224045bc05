"""The coordinator's staging pool: a byte budget shared by concurrent pushes.
Room goes in arrival order, and every lease gives its bytes back and passes
the room on, however its push ends."""

from __future__ import annotations

import asyncio
import contextlib

from coordinator.store import StagingPool

BUDGET = 100  # elements


def _pool() -> StagingPool:
    return StagingPool(budget_bytes=4 * BUDGET)


async def _hold(pool: StagingPool, numel: int, held: asyncio.Event,
                release: asyncio.Event | None = None, order: list[str] | None = None,
                name: str = "") -> None:
    async with pool.lease(numel) as lease:
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
        first = pool.lease(BUDGET)
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
            async with pool.lease(BUDGET):
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
