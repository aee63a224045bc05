"""Real coordinator daemons for tests, and waiting on conditions."""

from __future__ import annotations

import time

from chaos.local import CoordinatorProcess as Daemon

__all__ = ["Daemon", "wait_until"]


def wait_until(predicate: object, timeout: float = 30.0, interval: float = 0.05,
               message: str = "condition") -> None:
    """Poll `predicate()` until it is truthy; fail with `message` after `timeout`."""
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")
