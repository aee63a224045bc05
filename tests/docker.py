"""The ftsync image and docker commands for the container tests.

`image` builds the image once per test session with `deploy/docker/build` (its
base and wheelhouse are cached across runs on this machine). Everything a test
starts lives on a network or under a compose project named after the test, and
is removed at its end; the host reaches containers only through `docker exec`.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.daemon import wait_until

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "ftsync:test"


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    """Run the docker CLI; its stdout, or an assertion error with what it said."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {done.returncode}: "
                             f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def wait_for(predicate: Callable[[], object], timeout: float, message: str) -> None:
    """`wait_until`, polling every 0.5 s: each look is a `docker` command."""
    wait_until(predicate, timeout, 0.5, message)


@pytest.fixture(scope="session")
def image() -> str:
    """The image, built from this checkout."""
    built = subprocess.run([str(ROOT / "deploy" / "docker" / "build"), "--tag", IMAGE],
                           capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stderr[-4000:]
    print(built.stdout.strip())
    return IMAGE


@pytest.fixture
def network(request: pytest.FixtureRequest) -> Iterator[str]:
    """A user-defined network of the test's own; its containers go with it."""
    name = f"ftsync-test-{abs(hash(request.node.nodeid)) % 10**8}"
    docker("network", "create", name)
    try:
        yield name
    finally:
        for container in docker("ps", "-aq", "--filter", f"network={name}").split():
            docker("rm", "-f", container, check=False)
        docker("network", "rm", name, check=False)
