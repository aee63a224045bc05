"""The automatic quorum (`policy.min_quorum = "auto"`): the estimator and the policy.

`choose_quorum` is checked by properties (K within its bounds, K grows when noise
dominates, shrinks when a learner is slow) and by numbers worked out on paper; the
policy is driven by hand as in `test_policy.py`: the noise ratio it measures from
what rounds merged, the arrivals it expects, the choice each round records.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.policy import Policy, PolicyConfig, RoundClose, choose_quorum
from tests.unit.test_policy import contribute, make_offer

cycles_lists = st.lists(st.floats(0.01, 100.0), min_size=1, max_size=8).map(sorted)
noise = st.floats(0.0, 1e6)
fixed = st.floats(0.0, 10.0)


@given(cycles=cycles_lists, nu=st.one_of(st.none(), noise), fixed_s=fixed,
       ceiling=st.integers(1, 12))
def test_the_quorum_is_within_its_bounds(cycles: list[float], nu: float | None,
                                          fixed_s: float, ceiling: int) -> None:
    choice = choose_quorum(nu, cycles, fixed_s, ceiling)
    assert 1 <= choice.quorum <= min(len(cycles), ceiling)
    if nu is None:  # nothing measured yet: two, so that the round measures it
        assert choice.quorum == min(2, len(cycles), ceiling)


@given(cycles=cycles_lists, low=noise, high=noise, fixed_s=fixed)
def test_the_quorum_grows_when_noise_dominates(cycles: list[float], low: float,
                                               high: float, fixed_s: float) -> None:
    low, high = sorted((low, high))
    assert (choose_quorum(low, cycles, fixed_s, 99).quorum
            <= choose_quorum(high, cycles, fixed_s, 99).quorum)


@given(cycles=cycles_lists, slower=st.floats(0.0, 1000.0), nu=noise, fixed_s=fixed)
def test_the_quorum_shrinks_when_a_learner_is_slow(cycles: list[float], slower: float,
                                                   nu: float, fixed_s: float) -> None:
    # The slowest learner slower still (a straggler fault starting).
    slowed = [*cycles[:-1], cycles[-1] + slower]
    before = choose_quorum(nu, cycles, fixed_s, 99).quorum
    after = choose_quorum(nu, slowed, fixed_s, 99).quorum
    assert after <= before
    if slower > 0 and before < len(cycles):
        assert after == before  # waiting for others than the slowest costs the same


def test_choice_by_hand() -> None:
    # rate(k) = k·k/(k+ν) / (fixed + cycle_k), here with no fixed cost.
    # One learner pushing every second, three every 5 s, no noise: 1 for one against
    # 2/5 for two: one.
    assert choose_quorum(0.0, [1.0, 5.0, 5.0, 5.0], 0.0, 4).quorum == 1
    # The same with ν = 10: 1/11 against 4·4/14/5 = 0.23 for four: all four.
    assert choose_quorum(10.0, [1.0, 5.0, 5.0, 5.0], 0.0, 4).quorum == 4
    # Three learners every second and one every 4 s, ν = 2: 3·3/5 = 1.8 for three
    # against 4·4/6/4 = 0.67 for four: three.
    assert choose_quorum(2.0, [1.0, 1.0, 1.0, 4.0], 0.0, 4).quorum == 3
    # The ceiling caps it.
    assert choose_quorum(100.0, [1.0, 1.0, 1.0, 1.0], 0.0, 2).quorum == 2


# -- the policy measuring and choosing --------------------------------------------------


def auto(learners: tuple[str, ...] = ("a", "b", "c", "d"), **kw: Any) -> Policy:
    config = PolicyConfig(**{"min_quorum": "auto", "grace_max_s": 0.0,
                             "staleness_exponent": 0.0, "heartbeat_timeout_s": 1e3, **kw})
    policy = Policy(config, versions={0: 0})
    for lid in learners:
        policy.join(lid, 0.0)
    return policy


def push(policy: Policy, now: float, learner: str, seq: int, norm_sq: float) -> None:
    """A contribution of `learner` against the current version, with its Σ Δ²."""
    admission = policy.admit(make_offer(learner, seq=seq, base=policy.version(0)), now)
    policy.accept(admission, now, norm_sq=norm_sq)


def round_of(policy: Policy, now: float, norms: dict[str, float], seq: int) -> None:
    for lid, norm_sq in norms.items():
        push(policy, now, lid, seq, norm_sq)


def test_noise_is_measured_from_a_merged_round() -> None:
    policy = auto(("a", "b"))
    contribute_norm = {"a": 5.0, "b": 5.0}
    round_of(policy, 1.0, contribute_norm, seq=1)
    closed = policy.close(0, 1.0)
    assert closed.quorum == 2 and closed.choice is not None  # two: to measure the noise
    assert closed.choice.noise_ratio is None  # nothing measured before this round
    # Each ‖Δ_m‖² = 5, ‖Δ̄‖² = 3 with K_eff = 2: σ² = (5 − 3)/(1 − 1/2) = 4, ‖g‖² = 1.
    policy.record_merge(0, closed.version, 3.0)
    assert policy.noise_ratio(0) == pytest.approx(4.0)
    # Fed back for another version (or twice), it measures nothing.
    policy.record_merge(0, closed.version + 1, 0.0)
    policy.record_merge(0, closed.version, 0.0)
    assert policy.noise_ratio(0) == pytest.approx(4.0)


def test_a_fragment_takes_the_others_noise_before_it_has_its_own() -> None:
    """Only the run's first round waits for two to measure ν, not every fragment's."""
    config = PolicyConfig(min_quorum="auto", grace_max_s=0.0, staleness_exponent=0.0,
                          heartbeat_timeout_s=1e3)
    policy = Policy(config, versions={0: 0, 1: 0})
    for lid in ("a", "b", "c", "d"):
        policy.join(lid, 0.0)
    for lid in ("a", "b"):
        admission = policy.admit(make_offer(lid, fragment=0), 1.0)
        policy.accept(admission, 1.0, norm_sq=5.0)
    closed = policy.close(0, 1.0)
    assert closed.choice is not None and closed.choice.noise_ratio is None
    policy.record_merge(0, closed.version, 3.0)  # ν = 4, as above
    policy.accept(policy.admit(make_offer("a", fragment=1, seq=2), 2.0), 2.0, norm_sq=5.0)
    assert policy.round_quorum(1) == choose_quorum(4.0, [0.0] * 4, 0.0, 4).quorum == 4
    assert policy.noise_ratio(1) is None  # borrowed for the choice, not its own


def test_a_round_of_one_learner_measures_no_noise() -> None:
    policy = auto(("a",))
    round_of(policy, 1.0, {"a": 5.0}, seq=1)
    closed = policy.close(0, 1.0)
    policy.record_merge(0, closed.version, 5.0)
    assert policy.noise_ratio(0) is None


def run(policy: Policy, periods: dict[str, float], until: float, norms_sq: float,
        merged_sq: float) -> list[RoundClose]:
    """Learners pushing fragment 0 every `periods[lid]` s (offset by their order) until
    `until`, each round closed as soon as it is due and its merged norm fed back."""
    arrivals = sorted((i * 0.01 + n * period, lid) for i, (lid, period) in
                      enumerate(periods.items()) for n in range(1, int(until / period) + 1))
    seq = dict.fromkeys(periods, 0)
    closes = []
    for at, lid in arrivals:
        seq[lid] += 1
        push(policy, at, lid, seq[lid], norms_sq)
        for p in policy.due(at):
            closes.append(policy.close(p, at))
            policy.record_merge(p, closes[-1].version, merged_sq)
    return closes


def test_noise_dominating_makes_the_quorum_every_learner() -> None:
    policy = auto()
    # ‖Δ_m‖² = 10 against a merged 1: noise some 12 times the signal.
    closes = run(policy, {"a": 10.0, "b": 10.0, "c": 10.0, "d": 10.0}, until=60.0,
                 norms_sq=10.0, merged_sq=1.0)
    nu = policy.noise_ratio(0)
    assert nu is not None and nu > 5
    assert [c.quorum for c in closes][1:] == [4] * 5


def test_a_slow_learner_makes_the_quorum_smaller() -> None:
    policy = auto()
    # d pushes at a quarter of the others' rate; the noise is about the signal.
    closes = run(policy, {"a": 10.0, "b": 10.0, "c": 10.0, "d": 40.0}, until=200.0,
                 norms_sq=10.0, merged_sq=6.0)
    nu = policy.noise_ratio(0)
    assert nu is not None and 0.5 < nu < 2
    # The first round cycles for two, to measure the noise; once d's interval is
    # known, rounds stop waiting for it.
    assert closes[0].quorum == 2
    later = [c.quorum for c in closes[4:]]
    assert later and max(later) == 3
    assert all(c.choice is not None and c.choice.noise_ratio is not None for c in closes[4:])


def test_the_ceiling_bounds_the_choice() -> None:
    policy = auto(min_quorum_max=2)
    contribute(policy, 1.0, "a", seq=1)
    assert policy.round_quorum(0) == 2


def test_an_auto_round_does_not_wait_for_a_learner_that_died() -> None:
    policy = auto(("a", "b"), heartbeat_timeout_s=5.0)
    contribute(policy, 1.0, "a", seq=1)
    assert policy.round_quorum(0) == 2  # b was live when the round opened
    assert policy.due(2.0) == []
    policy.heartbeat("a", 7.0, local_step=1)
    assert policy.due(7.0) == [0]  # b's lease ran out: a is every live learner
    closed = policy.close(0, 7.0)
    assert closed.why == "all_live" and closed.quorum == 2
    assert closed.quorum_at == closed.closed_at == 7.0


def test_config_takes_auto_and_refuses_other_words() -> None:
    assert PolicyConfig(min_quorum="auto").min_quorum == "auto"
    with pytest.raises(ValueError, match=r"policy\.min_quorum "):
        PolicyConfig(min_quorum="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"policy\.min_quorum_max"):
        PolicyConfig(min_quorum_max=-1)
