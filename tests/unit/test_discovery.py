"""Where learners and replicas find each other: etcd URLs, the leader record,
the etcd channel targets, and how a learner reads a standby's redirect (from the
refusal's trailing metadata, never its message)."""

from __future__ import annotations

import grpc
import pytest

from coordinator.etcd import channel_targets
from learner.client import Refused, SynchronizerClient
from learner.routing import WrongReplica
from protos.discovery import LeaderRecord, ReplicaRecord, leader_key, parse_etcd_url
from protos.metadata import LEADER


def test_etcd_urls() -> None:
    assert parse_etcd_url("etcd://127.0.0.1:2379") == (["127.0.0.1:2379"], "default")
    assert parse_etcd_url("etcd://a:1,b:2/exp-7") == (["a:1", "b:2"], "exp-7")
    with pytest.raises(ValueError):
        parse_etcd_url("etcd:///run")
    assert leader_key("exp-7") == b"/ftsync/exp-7/leader"


def test_leader_record_takes_its_epoch_from_the_key() -> None:
    record = LeaderRecord("r1", "10.0.0.1:50051", 0)
    assert LeaderRecord.decode(record.encode(), 42) == LeaderRecord("r1", "10.0.0.1:50051", 42)
    assert LeaderRecord.decode(b"garbage", 7) == LeaderRecord("", "", 7)


def test_a_replica_record_says_whether_it_reads_streams_without_momentum() -> None:
    record = ReplicaRecord("r2", "10.0.0.2:50051")
    assert ReplicaRecord.decode(record.encode()) == record and record.zero_momentum
    # A replica of an older build registers no such field: it gets the whole record.
    older = b'{"replica": "r3", "address": "10.0.0.3:50051"}'
    assert ReplicaRecord.decode(older) == ReplicaRecord("r3", "10.0.0.3:50051", False)
    for garbage in (b"garbage", b"[1]", b'{"replica": "r4"}'):
        assert ReplicaRecord.decode(garbage) is None
    # Only a JSON true says so: anything else is read as an older build's record.
    unsure = b'{"replica": "r4", "address": "a:1", "zero_momentum": "yes"}'
    assert ReplicaRecord.decode(unsure) == ReplicaRecord("r4", "a:1", False)


def test_etcd_targets() -> None:
    assert channel_targets(["127.0.0.1:1"]) == [("127.0.0.1", 1)]
    # IPv4 members share one channel that fails over; named hosts go one by one.
    assert channel_targets(["127.0.0.1:1", "127.0.0.2:2"]) == [("ipv4:127.0.0.1:1,127.0.0.2", 2)]
    assert channel_targets(["etcd-0:1", "etcd-1:2"]) == [("etcd-0", 1), ("etcd-1", 2)]


def test_a_learner_ignores_answers_from_an_older_epoch() -> None:
    client = SynchronizerClient("a:1, b:2", "l0", "layout", [10])
    assert client.replicas.addresses == ["a:1", "b:2"] and client.address == "a:1"
    client.replicas.check_epoch(5)
    client.replicas.check_epoch(5)
    with pytest.raises(WrongReplica):
        client.replicas.check_epoch(4)
    assert client.replicas.epoch == 5
    assert SynchronizerClient("etcd://h:1/r", "l0", "layout", [10]).address == ""


@pytest.mark.parametrize(("details", "metadata", "leader"), [
    ("not_leader: leader is 10.0.0.2:50051 (epoch 7)",
     (("ftsync-reason", "not_leader"), ("ftsync-leader", "10.0.0.2:50051")), "10.0.0.2:50051"),
    ("not_leader: no leader is elected yet; retry shortly",
     (("ftsync-reason", "not_leader"),), ""),
    # The message's words are for people: a leader named only there is not followed.
    ("not_leader: leader is 10.0.0.2:50051 (epoch 7)", (("ftsync-reason", "not_leader"),), ""),
])
def test_a_refusal_names_the_leader_in_its_trailing_metadata(
        details: str, metadata: tuple[tuple[str, str], ...], leader: str) -> None:
    error = grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                 grpc.aio.Metadata(*metadata), details)
    refused = Refused.of(error)
    assert refused.reason == "not_leader"
    assert refused.facts.get(LEADER, "") == leader
    assert refused.details == details


def test_a_refusal_without_a_reason_code_has_none() -> None:
    error = grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                 grpc.aio.Metadata(), "not_leader: leader is h:1 (epoch 2)")
    assert Refused.of(error).reason == ""
