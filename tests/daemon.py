"""Real coordinator daemons for tests, and waiting on conditions."""

from __future__ import annotations

import time
from typing import Any

from chaos.local import CoordinatorProcess as Daemon
from chaos.proxy import ThreadedProxy, listening_ports

__all__ = ["Daemon", "proxy_in_front", "wait_until"]


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


def proxy_in_front(daemon: Daemon, host: str = "127.0.0.2", **options: Any) -> ThreadedProxy:
    """A fault proxy on `host` in front of every port `daemon` listens on: its gRPC
    port, and the bulk port its tickets name (mirrored at the same number), so no
    connection of a learner that dials the proxy goes around it."""
    assert daemon.process is not None
    mirrored = tuple(p for p in listening_ports(daemon.process.pid) if p != daemon.port)
    return ThreadedProxy(daemon.address, host=host, mirror_ports=mirrored, **options)
