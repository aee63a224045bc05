"""Replication as a standby sees it: the wire format of one replicated version,
and the engine's rules for which leader's writes it takes (no etcd needed)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import CoordinatorConfig, HaConfig
from coordinator.durability import FragmentRecord, RunRecord, StateDir, new_commit_id
from coordinator.engine import Engine
from coordinator.errors import NotLeader, Reason, Rejected
from coordinator.replication import read_replica, replica_messages
from protos import ftsync_pb2 as pb
from tests.unit.test_leadership import Elected

RUN = RunRecord("run-1", "layout", (3000, 5_000_000))


def record(version: int, epoch: int, fragment: int = 0, seed: int = 0) -> FragmentRecord:
    rng = np.random.default_rng(seed)
    numel = RUN.numels[fragment]
    return FragmentRecord(fragment, version, rng.standard_normal(numel).astype(np.float32),
                          rng.standard_normal(numel).astype(np.float32), {"a": version},
                          [{"learner": "a", "seq": version}], epoch, new_commit_id())


async def stream(messages: Iterable[pb.ReplicaMessage]) -> AsyncIterator[pb.ReplicaMessage]:
    for message in messages:
        yield message


def roundtrip(messages: Iterable[pb.ReplicaMessage]) -> tuple[int, RunRecord, FragmentRecord]:
    epoch, run, got, transport = asyncio.run(read_replica(stream(messages)))
    assert transport == "grpc"
    return epoch, run, got


def test_a_version_survives_the_wire_bit_for_bit() -> None:
    for fragment in (0, 1):  # one chunk, and many chunks (5M elements)
        sent = record(7, epoch=3, fragment=fragment, seed=fragment)
        epoch, run, got = roundtrip(replica_messages(9, "r0", RUN, sent))
        assert (epoch, run) == (9, RUN)
        assert (got.fragment, got.version, got.epoch) == (fragment, 7, 3)
        assert got.commit_id == sent.commit_id != 0
        assert got.watermarks == sent.watermarks and got.manifest == sent.manifest
        np.testing.assert_array_equal(got.params, sent.params)
        np.testing.assert_array_equal(got.momentum, sent.momentum)


def test_an_all_zero_momentum_is_left_out_and_comes_back_zero() -> None:
    sent = record(7, epoch=3, fragment=1)
    sent.momentum[:] = 0
    sent.zero_momentum = True
    whole = list(replica_messages(9, "r0", RUN, sent))
    messages = list(replica_messages(9, "r0", RUN, sent, zero_momentum=True))
    assert messages[0].header.zero_momentum and not whole[0].header.zero_momentum

    def payload(stream: list[pb.ReplicaMessage]) -> int:
        return sum(len(m.chunk.data) for m in stream[1:])

    assert payload(messages) == 4 * sent.params.size == payload(whole) // 2
    _, _, got = roundtrip(messages)
    np.testing.assert_array_equal(got.params, sent.params)
    assert got.zero_momentum and got.momentum.shape == sent.momentum.shape
    assert not got.momentum.any()
    # The header is the contract: the momentum's chunks after it are one vector too many.
    with pytest.raises(Rejected) as too_long:
        roundtrip([messages[0], *whole[1:]])
    assert too_long.value.reason in (Reason.BAD_SHAPE, Reason.MALFORMED)


def test_malformed_streams_are_refused() -> None:
    messages = list(replica_messages(1, "r0", RUN, record(1, 1)))
    with pytest.raises(Rejected) as missing:
        roundtrip(messages[:-1])
    assert missing.value.reason == Reason.BAD_SHAPE
    with pytest.raises(Rejected) as headless:
        roundtrip(messages[1:])
    assert headless.value.reason == Reason.MALFORMED
    wrong = RunRecord("run-1", "layout", (10, 10))
    with pytest.raises(Rejected) as misfit:
        roundtrip(replica_messages(1, "r0", wrong, record(1, 1)))
    assert misfit.value.reason == Reason.BAD_SHAPE


def standby(tmp_path: Path) -> Engine:
    config = CoordinatorConfig(state_dir=str(tmp_path / "state"), fsync=False,
                               ha=HaConfig(etcd=("127.0.0.1:2379",)))
    return Engine(config, Elected())


def test_a_standby_takes_the_newest_epoch_and_refuses_older_ones(tmp_path: Path) -> None:
    engine = standby(tmp_path)
    assert engine.role == "standby"
    with pytest.raises(NotLeader):
        engine.require_leader()

    async def scenario() -> None:
        assert await engine.apply_replica(5, RUN, record(3, epoch=5)) == 5
        # The same leader again, older or equal: already here, nothing written.
        await engine.apply_replica(5, RUN, record(2, epoch=5, seed=9))
        state = StateDir(tmp_path / "state")
        on_disk = state.load_fragment(0)
        assert on_disk is not None and (on_disk.version, on_disk.epoch) == (3, 5)
        # A newer leader may move the fragment anywhere (it resynchronises us).
        await engine.apply_replica(8, RUN, record(2, epoch=5, seed=4))
        on_disk = state.load_fragment(0)
        assert on_disk is not None and on_disk.version == 2
        # A deposed leader's late write is refused and changes nothing.
        with pytest.raises(Rejected) as stale:
            await engine.apply_replica(5, RUN, record(9, epoch=5))
        assert stale.value.reason == Reason.STALE_EPOCH
        on_disk = state.load_fragment(0)
        assert on_disk is not None and on_disk.version == 2
        assert state.load_run() == RUN
        assert [m["epoch"] for m in state.manifests()] == [5, 5]

    asyncio.run(scenario())


def test_promotion_resumes_from_the_replicated_state(tmp_path: Path) -> None:
    engine = standby(tmp_path)

    async def scenario() -> None:
        await engine.apply_replica(4, RUN, record(6, epoch=4))
        await engine.promote(11, None)
        assert engine.role == "leader" and engine.epoch == 11
        assert engine.run == RUN
        assert engine.views("a")[0].version == 6 and engine.views("a")[0].merged_seq == 6
        # A leader refuses replication from its own or an older epoch...
        with pytest.raises(Rejected):
            await engine.apply_replica(11, RUN, record(7, epoch=11))
        # ...and steps down for a newer one.
        await engine.apply_replica(12, RUN, record(7, epoch=12))
        assert (engine.role, engine.policy) == ("standby", None)

    asyncio.run(scenario())
