from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from protos.tls import TlsConfig
from tests.daemon import Daemon
from tests.docker import image, network, start_build, stop_build  # noqa: F401 (fixtures)
from tests.etcd import etcd, etcd_cluster  # noqa: F401 (fixtures)


def pytest_collection_finish(session: pytest.Session) -> None:
    start_build(session)


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_build(session)


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start coordinator daemons (stopped at the end); `start_daemon(*args)`."""
    daemons: list[Daemon] = []

    def start(*args: str, state_dir: Path | None = None, port: int = 0,
              admin_tls: TlsConfig | None = None) -> Daemon:
        daemon = Daemon(state_dir=state_dir or tmp_path / f"state{len(daemons)}",
                        args=list(args), port=port, admin_tls=admin_tls)
        daemons.append(daemon)
        return daemon.start()

    yield start
    for daemon in daemons:
        daemon.stop()


@pytest.fixture
def daemon(start_daemon: Callable[..., Daemon]) -> Daemon:
    return start_daemon()
