"""Which replica a learner calls (`learner.routing.Replicas`): hints, the next
address, etcd's answer, epochs and recent failures."""

from __future__ import annotations

import pytest

from learner.routing import Replicas, WrongReplica


def test_without_a_leader_named_it_goes_round_the_addresses() -> None:
    replicas = Replicas(" a:1, b:2 ,,c:3")
    assert replicas.addresses == ["a:1", "b:2", "c:3"] and replicas.several
    for expected in ["b:2", "c:3", "a:1"]:
        replicas.move("", failed=False)
        assert replicas.address == expected
    assert not Replicas("a:1").several


def test_a_leader_named_is_followed_and_remembered() -> None:
    replicas = Replicas("a:1,b:2")
    replicas.move("b:2", failed=False)
    assert replicas.address == "b:2"
    replicas.move("z:9", failed=True)  # one the list did not name
    assert replicas.addresses == ["a:1", "b:2", "z:9"] and replicas.address == "z:9"


def test_under_etcd_a_replica_that_refused_is_kept_until_etcd_names_a_leader() -> None:
    replicas = Replicas("etcd://h:1,h:2/run-7")
    assert replicas.etcd == (["h:1", "h:2"], "run-7") and replicas.several
    assert replicas.address == ""
    replicas.move("", failed=False)  # etcd named none, and there is none to leave
    assert replicas.address == ""
    replicas.move("a:1", failed=False)
    replicas.move("b:2", failed=False)
    replicas.move("", failed=False)  # a standby knowing no leader: a campaign under way
    assert replicas.address == "b:2"
    replicas.move("", failed=True)  # it failed: the next one
    assert replicas.address == "a:1"


def test_an_answer_from_an_older_epoch_is_a_wrong_replica_and_changes_nothing() -> None:
    replicas = Replicas("a:1")
    replicas.check_epoch(3)
    with pytest.raises(WrongReplica, match="a:1 answered for epoch 2, but epoch 3"):
        replicas.check_epoch(2)
    assert replicas.epoch == 3
    replicas.check_epoch(4)
    assert replicas.epoch == 4


def test_a_recent_failure_is_remembered_per_replica() -> None:
    replicas = Replicas("a:1,b:2")
    replicas.failed("a:1", now=10.0)
    assert replicas.failed_within("a:1", now=11.5, window_s=2.0)
    assert not replicas.failed_within("a:1", now=12.0, window_s=2.0)
    assert not replicas.failed_within("b:2", now=10.0, window_s=2.0)
