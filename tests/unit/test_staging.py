"""The coordinator's staging pool: a byte budget shared by concurrent pushes.
Every lease gives its bytes back, however its push ends."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from coordinator.store import StagingPool


async def _hold(pool: StagingPool, numel: int, held: asyncio.Event) -> None:
    async with pool.lease(numel) as lease:
        assert lease.buffer is not None and lease.buffer.size == numel
        held.set()
        await asyncio.sleep(60)


def test_a_push_waits_for_room_and_gets_it_when_another_ends() -> None:
    async def scenario() -> None:
        pool = StagingPool(budget_bytes=4 * 100)
        first_held, second_held = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(_hold(pool, 80, first_held))
        await first_held.wait()
        second = asyncio.create_task(_hold(pool, 80, second_held))
        await asyncio.sleep(0.05)
        assert not second_held.is_set() and pool.in_use == 4 * 80
        first.cancel()
        await asyncio.wait_for(second_held.wait(), 5)
        assert pool.in_use == 4 * 80
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        assert pool.in_use == 0

    asyncio.run(scenario())


def test_a_push_cancelled_while_waiting_for_room_takes_none() -> None:
    async def scenario() -> None:
        pool = StagingPool(budget_bytes=4 * 100)
        held = asyncio.Event()
        first = asyncio.create_task(_hold(pool, 80, held))
        await held.wait()
        waiting = asyncio.create_task(_hold(pool, 80, asyncio.Event()))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert pool.in_use == 4 * 80
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert pool.in_use == 0

    asyncio.run(scenario())


def test_a_lease_ends_without_giving_the_loop_a_turn() -> None:
    """A push whose stream ends short leaves its lease and goes on to count the
    cut (`Engine.wait_out_cut`); a suspension on the way out would let gRPC's
    cancellation land there instead, and the cut would go uncounted."""
    async def scenario() -> None:
        pool = StagingPool(budget_bytes=4 * 100)
        other = asyncio.create_task(_hold(pool, 10, asyncio.Event()))
        await asyncio.sleep(0)
        turns = 0

        async def count_turns() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        counter = asyncio.create_task(count_turns())
        await asyncio.sleep(0)
        before = turns
        with contextlib.suppress(ValueError):
            async with pool.lease(20):
                raise ValueError("stream ended short")
        assert turns == before and pool.in_use == 4 * 10
        for task in (other, counter):
            task.cancel()
        await asyncio.gather(other, counter, return_exceptions=True)
        assert pool.in_use == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("numel", [10, 1000])
def test_a_fragment_larger_than_the_budget_still_gets_in_alone(numel: int) -> None:
    async def scenario() -> None:
        pool = StagingPool(budget_bytes=4 * 50)
        async with pool.lease(numel) as lease:
            assert lease.buffer is not None and pool.in_use == 4 * numel
        assert pool.in_use == 0

    asyncio.run(scenario())
