"""The engine under each leadership it is built with, without etcd or `coordinator.ha`:
embedded it leads from the start and publishes at once; elected it refuses learners
until promoted, naming the leader the election saw, and publishes only what it
handed to its standbys while its lease held."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import CoordinatorConfig, HaConfig, OuterConfig
from coordinator.durability import FragmentRecord, RunRecord
from coordinator.engine import Engine
from coordinator.errors import NotLeader
from coordinator.leadership import AlwaysLeader, Leadership
from coordinator.service import status_of
from protos import ftsync_pb2 as pb
from protos.codec import codec_named, iter_chunk_messages
from protos.discovery import LeaderRecord
from protos.metadata import LEADER

NUMEL = 64
LAYOUT = pb.Layout(hash="layout", fragments=[pb.FragmentSpec(fragment=0, numel=NUMEL)])
JOIN = pb.JoinRequest(learner_id="a", layout=LAYOUT)


class Elected(Leadership):
    """An elected replica's leadership with the election left out: the lease holds
    while `lease` says so, and what the engine hands over is kept to look at."""

    elected = True

    def __init__(self, replica_id: str = "r1", address: str = "127.0.0.1:7001") -> None:
        self.replica_id = replica_id
        self.address = address
        self.lease = True
        self.replicated: list[tuple[int, int]] = []
        self.resigned: list[str] = []
        self.runs: list[RunRecord] = []
        # Raised by `replicate` when set: a standby knows a newer epoch.
        self.deposed: NotLeader | None = None

    def holds(self) -> bool:
        return self.lease

    async def replicate(self, record: FragmentRecord) -> None:
        if self.deposed is not None:
            raise self.deposed
        self.replicated.append((record.fragment, record.version))

    def resign(self, reason: str) -> None:
        self.resigned.append(reason)

    def run_created(self, run: RunRecord) -> None:
        self.runs.append(run)


def engine_in(tmp_path: Path, leadership: Leadership | None = None,
              ha: HaConfig | None = None, outer: OuterConfig | None = None) -> Engine:
    config = CoordinatorConfig(state_dir=str(tmp_path / "state"), fsync=False,
                               event_log=str(tmp_path / "events.jsonl"), ha=ha or HaConfig(),
                               outer=outer or OuterConfig())
    return Engine(config, leadership)


def run(engine: Engine, scenario: Callable[[], Awaitable[None]]) -> None:
    async def started() -> None:
        await engine.start()
        try:
            await scenario()
        finally:
            await engine.stop()

    asyncio.run(started())


async def push(engine: Engine, seq: int, init: bool = False,
               before_chunks: Callable[[], Awaitable[None]] | None = None) -> None:
    """Learner a's initial value of fragment 0, or a contribution against version 0;
    `before_chunks` is awaited when the engine asks for the first chunk."""
    values = np.full(NUMEL, 1.0 if init else 0.01, np.float32)
    header = pb.PushHeader(learner_id="a", fragment=0, layout_hash="layout", seq=seq,
                           base_version=0, c_tokens=100, c_steps=10, codec=pb.CODEC_FP32,
                           numel=NUMEL, init=init)

    async def chunks() -> AsyncIterator[pb.PushMessage]:
        if before_chunks is not None:
            await before_chunks()
        for message in iter_chunk_messages(values, codec_named("fp32"), pb.PushMessage):
            yield message

    await engine.push(header, chunks())


async def committed(engine: Engine) -> None:
    """Until fragment 0 publishes version 1 (learner a alone closes its round)."""
    assert engine.store is not None
    published = await engine.store.wait_newer(0, 0, 10.0)
    assert published is not None and published.version == 1


def events(tmp_path: Path, kind: str) -> list[dict[str, object]]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def test_an_engine_built_without_a_leadership_always_leads(tmp_path: Path) -> None:
    engine = engine_in(tmp_path)
    assert isinstance(engine.leadership, AlwaysLeader)

    async def scenario() -> None:
        assert engine.serving
        assert engine.join(JOIN).next_seq == 1
        await push(engine, 1, init=True)
        await push(engine, 2)
        await committed(engine)
        engine.heartbeat("a", local_step=5, backlog=0)
        status = status_of(engine)
        assert (status.role, status.leader, status.replica_id) == ("leader", "", "")
        # Each learner's counts are read where they are kept: bytes in from the
        # metrics (two pushes of fp32 values), its step from the policy.
        (learner,) = status.learners
        assert learner.bytes_in == status.bytes_in == 2 * 4 * NUMEL
        assert (learner.local_step, learner.contributions) == (5, 1)

    run(engine, scenario)
    # Embedded, no commit is stamped with an epoch: there is no election.
    (commit,) = events(tmp_path, "commit")
    assert commit["version"] == 1 and "epoch" not in commit


def test_an_elected_engine_redirects_until_promoted_and_publishes_what_it_replicated(
        tmp_path: Path) -> None:
    leadership = Elected()
    engine = engine_in(tmp_path, leadership, HaConfig(etcd=("127.0.0.1:2379",)))

    async def scenario() -> None:
        assert engine.role == "standby" and not engine.serving
        with pytest.raises(NotLeader) as nobody:
            engine.join(JOIN)
        assert nobody.value.leader == "" and nobody.value.facts == ()
        engine.leader_seen(LeaderRecord("r2", "127.0.0.1:7002", 7))
        with pytest.raises(NotLeader) as elsewhere:
            engine.join(JOIN)
        assert (elsewhere.value.leader, elsewhere.value.epoch) == ("127.0.0.1:7002", 7)
        assert elsewhere.value.facts == ((LEADER, "127.0.0.1:7002"),)
        status = status_of(engine)
        assert (status.role, status.epoch, status.leader) == ("standby", 7, "127.0.0.1:7002")
        assert leadership.runs == []

        await engine.promote(9, None)
        engine.leader_seen(LeaderRecord("r1", leadership.address, 9))
        assert engine.serving and engine.leader_address == leadership.address
        engine.join(JOIN)
        assert [r.layout_hash for r in leadership.runs] == ["layout"]
        await push(engine, 1, init=True)
        await push(engine, 2)
        await committed(engine)
        assert leadership.replicated == [(0, 0), (0, 1)]
        assert status_of(engine).replica_id == "r1"

        # The lease lapses: learners are told no leader is known.
        leadership.lease = False
        with pytest.raises(NotLeader) as lapsed:
            engine.join(JOIN)
        assert (lapsed.value.leader, lapsed.value.epoch) == ("", 9)
        assert not engine.serving

    run(engine, scenario)
    assert [e["epoch"] for e in events(tmp_path, "elected")] == [9]
    assert [e["epoch"] for e in events(tmp_path, "commit")] == [9]


def test_an_elected_engine_that_cannot_replicate_steps_down_and_resigns(
        tmp_path: Path) -> None:
    leadership = Elected()
    engine = engine_in(tmp_path, leadership, HaConfig(etcd=("127.0.0.1:2379",)))

    async def scenario() -> None:
        await engine.promote(3, None)
        engine.join(JOIN)
        leadership.deposed = NotLeader("", 4)
        with pytest.raises(NotLeader):
            await push(engine, 1, init=True)
        assert (engine.role, engine.policy) == ("standby", None)
        assert len(leadership.resigned) == 1
        assert "cannot replicate version 0 of fragment 0" in leadership.resigned[0]
        assert leadership.replicated == []

    run(engine, scenario)


def test_a_push_that_streams_across_a_step_down_and_a_new_term_is_refused_not_acked(
        tmp_path: Path) -> None:
    """A leader whose lease lapsed mid-push and that was elected again under a new
    epoch: the push began with the old term's round, which is gone. Acknowledged, it
    would be merged nowhere (a loaded CI run's docker partition test lost one so);
    refused, the learner pushes it again to the new term, which takes it."""
    leadership = Elected()
    engine = engine_in(tmp_path, leadership, HaConfig(etcd=("127.0.0.1:2379",)))
    waiting, release = asyncio.Event(), asyncio.Event()

    async def held() -> None:
        waiting.set()  # admitted and staged: the engine asks for its chunk
        await release.wait()

    async def scenario() -> None:
        await engine.promote(3, None)
        engine.join(JOIN)
        await push(engine, 1, init=True)
        streaming = asyncio.ensure_future(push(engine, 2, before_chunks=held))
        await waiting.wait()
        engine.demote("lease not renewed in time")
        await engine.promote(4, None)
        engine.leader_seen(LeaderRecord("r1", leadership.address, 4))
        release.set()
        with pytest.raises(NotLeader) as refused:
            await streaming
        assert refused.value.leader == leadership.address
        # Joined again (a learner does on NotLeader), the push is taken and merged.
        engine.join(JOIN)
        await push(engine, 2)
        await committed(engine)
        assert engine.store is not None
        assert engine.store.slots[0].published is not None

    run(engine, scenario)
    (commit,) = events(tmp_path, "commit")
    assert commit["epoch"] == 4 and [m["seq"] for m in commit["manifest"]] == [2]


def test_a_commit_is_logged_at_its_publication_even_when_logged_late(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader SIGSTOPped between publishing a version and logging it wrote the
    commit with the time it resumed, after the commits of the epoch elected
    meanwhile: the harness saw a split brain that never was. The line carries the
    publication's time instead."""
    leadership = Elected()
    engine = engine_in(tmp_path, leadership, HaConfig(etcd=("127.0.0.1:2379",)))
    emit = engine.events.emit
    logged_from: list[float] = []

    def stopped_before_commit_lines(kind: str, t: float | None = None, **fields: object) -> None:
        if kind == "commit":
            stopped_at = time.time()
            logged_from.append(stopped_at)
            # The stop: the line is written only once the clock has moved past it.
            while time.time() <= stopped_at:
                pass
        emit(kind, t, **fields)

    monkeypatch.setattr(engine.events, "emit", stopped_before_commit_lines)

    async def scenario() -> None:
        await engine.promote(3, None)
        engine.join(JOIN)
        await push(engine, 1, init=True)
        pushed = time.time()
        await push(engine, 2)
        await committed(engine)
        logged_from.append(pushed)

    run(engine, scenario)
    (commit,) = events(tmp_path, "commit")
    late, pushed = logged_from
    assert pushed <= commit["t"] <= late
