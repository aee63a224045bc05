"""What a learner holds for its peers, and the peer settings' validation."""

from __future__ import annotations

import numpy as np
import pytest

from learner.peers import HeldFragments, PeerSettings, split_address


def values(x: float) -> np.ndarray:
    return np.full(4, x, dtype=np.float32)


def test_a_learner_holds_the_version_it_applied_and_a_newer_one_it_pulled() -> None:
    held = HeldFragments()
    held.applied(0, 3, 30, values(3))
    held.pulled(0, 4, 40, values(4))
    assert held.versions() == [(0, 3, 30), (0, 4, 40)]
    got = held.get(0, 4, 40)
    assert got is not None and got[0] == 4
    assert held.get(0, 5, 50) is None
    # Applying 4 drops nothing servable, only the duplicate; applying 5 drops 3 and 4.
    held.applied(0, 4, 40, values(4))
    assert held.versions() == [(0, 4, 40)]
    held.pulled(0, 5, 50, values(5))
    held.applied(0, 5, 50, values(5))
    assert held.versions() == [(0, 5, 50)]
    # An older pull, arriving late, is not kept.
    held.pulled(0, 4, 40, values(4))
    assert held.versions() == [(0, 5, 50)]


def test_a_version_is_served_only_under_the_commit_it_was_pulled_as() -> None:
    held = HeldFragments()
    held.applied(0, 5, 50, values(5))
    # Version 5 committed again (the coordinator lost versions) is another commit.
    assert held.get(0, 5, 51) is None
    assert held.get(0, 5, 50) is not None
    # Pulled, the new commit is servable before it is applied; the same one is no news.
    held.pulled(0, 5, 50, values(5))
    held.pulled(0, 5, 51, values(-5))
    assert held.versions() == [(0, 5, 50), (0, 5, 51)]
    got = held.get(0, 5, 51)
    assert got is not None and got[0] == -5
    held.applied(0, 5, 51, values(-5))
    assert held.versions() == [(0, 5, 51)]


def test_held_arrays_are_the_runtimes_own_not_copies() -> None:
    held = HeldFragments()
    mine = values(1)
    held.applied(1, 0, 10, mine)
    assert held.get(1, 0, 10) is mine


def test_a_push_or_pull_under_way_may_bring_only_newer_versions() -> None:
    held = HeldFragments()
    held.applied(0, 2, 20, values(2))
    assert not held.may_arrive(0, 3)
    with held.awaiting(0, 2):
        assert held.may_arrive(0, 3) and not held.may_arrive(0, 2)
        assert not held.may_arrive(1, 3)
    assert not held.may_arrive(0, 3)


def test_overlapping_waits_each_end_only_themselves() -> None:
    held = HeldFragments()
    cancelled = held.awaiting(0, 2)
    cancelled.__enter__()
    with held.awaiting(0, 4):
        # The earlier wait ends (a cancelled pull) while the fall-back's goes on.
        cancelled.__exit__(None, None, None)
        assert held.may_arrive(0, 5) and not held.may_arrive(0, 3)
    assert not held.may_arrive(0, 5)


@pytest.mark.parametrize("kwargs, message", [
    ({"transport": "udp"}, "transport"),
    ({"peers": ("no-port",)}, "HOST:PORT"),
    ({"serve": "host:port"}, "HOST:PORT"),
    ({"concurrency": 0}, "concurrency"),
])
def test_bad_peer_settings_are_refused_with_the_reason(kwargs: dict[str, object],
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PeerSettings(**kwargs)  # type: ignore[arg-type]


def test_addresses_split_for_ipv4_names_and_ipv6() -> None:
    assert split_address("10.0.0.1:7000") == ("10.0.0.1", 7000)
    assert split_address("learner-3:0") == ("learner-3", 0)
    assert split_address("[::1]:7000") == ("::1", 7000)

