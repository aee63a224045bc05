"""`coordinator.daemon.Drainer`, the order of a drain, against a fake engine and replica.

One drain however many calls ask; a leader that finds no standby in sync once
its open rounds are committed takes rounds again, refuses, and may be asked
again; a drain that hands over says to whom, and only then lets the daemon exit.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from coordinator.daemon import Drainer
from coordinator.engine import Drained
from coordinator.errors import Reason, Rejected
from protos.discovery import LeaderRecord


class FakeEngine:
    def __init__(self) -> None:
        self.draining = False
        self.drains = 0
        self.undrained: list[str] = []
        self.release = asyncio.Event()

    async def drain(self, timeout_s: float) -> Drained:
        self.drains += 1
        self.draining = True
        await self.release.wait()
        return Drained("leader", 2, [])

    def undrain(self, reason: str) -> None:
        self.draining = False
        self.undrained.append(reason)


class FakeReplica:
    def __init__(self) -> None:
        self.in_sync = False
        self.asked: list[bool] = []

    async def await_standby(self, timeout_s: float, in_sync: bool) -> None:
        self.asked.append(in_sync)
        if in_sync and not self.in_sync:
            raise Rejected(Reason.NO_STANDBY, "no standby in sync answered")

    async def leave(self, timeout_s: float) -> LeaderRecord:
        return LeaderRecord("r1", "127.0.0.1:2", 9)


def drainer(engine: FakeEngine, replica: FakeReplica | None) -> Drainer:
    fake: Any = engine, replica
    return Drainer(*fake)


def test_calls_share_one_drain_and_the_daemon_exits_after_it() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        drain = drainer(engine, None)
        calls = [asyncio.ensure_future(drain(0)) for _ in range(3)]
        await asyncio.sleep(0)
        assert not drain.done.is_set()
        engine.release.set()
        responses = await asyncio.gather(*calls)
        assert engine.drains == 1 and drain.done.is_set()
        assert {(r.role, r.rounds_committed, r.leader) for r in responses} == {("leader", 2, "")}

    asyncio.run(scenario())


def test_no_standby_in_sync_after_the_drain_takes_rounds_again_and_may_be_retried() -> None:
    async def scenario() -> None:
        engine, replica = FakeEngine(), FakeReplica()
        engine.release.set()
        drain = drainer(engine, replica)
        with pytest.raises(Rejected) as refused:
            await drain(1.0)
        assert refused.value.reason is Reason.NO_STANDBY
        assert replica.asked == [False, True]  # a standby at all first, then one in sync
        assert not engine.draining and engine.undrained == ["no standby in sync answered"]
        assert not drain.done.is_set()
        replica.in_sync = True
        response = await drain(1.0)
        assert engine.drains == 2 and drain.done.is_set()
        assert (response.leader, response.epoch) == ("127.0.0.1:2", 9)

    asyncio.run(scenario())


@pytest.mark.parametrize("timeout_s", [-1.0, float("inf"), float("nan")])
def test_a_timeout_that_is_no_time_is_refused(timeout_s: float) -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        with pytest.raises(Rejected) as refused:
            await drainer(engine, None)(timeout_s)
        assert refused.value.reason is Reason.MALFORMED and engine.drains == 0

    asyncio.run(scenario())
