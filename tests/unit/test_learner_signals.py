"""A signal while `ftsync-learner` joins: it interrupts the join until the join
is done, and from that instant on ends the run cleanly instead; no instant is
left in which the signal's default action would kill the learner unannounced."""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Iterator

import pytest

from learner.cli import _Run, _start

ARGS = argparse.Namespace(learner_id="l0", coordinator="127.0.0.1:9", connect_timeout=1.0)


@pytest.fixture(autouse=True)
def own_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_the_join_is_done_interrupts_it(
        sig: signal.Signals, capsys: pytest.CaptureFixture[str]) -> None:
    run = _Run("l0")

    def start() -> None:
        os.kill(os.getpid(), sig)
        raise AssertionError("the signal should have interrupted the join")

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    assert _start(start, lambda: False, run, ARGS) == 128 + sig
    assert f"interrupted ({sig.name}) while joining" in capsys.readouterr().err
    # Exiting now: the handlers from before the join are back.
    assert {s: signal.getsignal(s) for s in handlers} == handlers


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_once_the_join_is_done_ends_the_run_before_its_first_step(
        sig: signal.Signals) -> None:
    run, joined = _Run("l0"), False

    def start() -> None:
        nonlocal joined
        joined = True  # the join's last act; start has yet to return
        os.kill(os.getpid(), sig)

    assert _start(start, lambda: joined, run, ARGS) == 0
    assert run.stop_signal == sig.name
    # The run's own handlers are set: a second signal too is only recorded.
    other = signal.SIGINT if sig == signal.SIGTERM else signal.SIGTERM
    os.kill(os.getpid(), other)
    assert run.stop_signal == other.name
