"""The ftsync image and docker commands for the container tests.

`image` builds the image once per test session with `deploy/docker/build` (its
base and wheelhouse are cached across runs on this machine). The build starts as
soon as collection shows a test that needs it (`start_build`, from the conftest),
so that on a fresh machine its three minutes or so (debootstrap, the wheelhouse,
an uncached `docker build`) overlap the tests that run before the container
tests instead of adding to the suite's time. Everything a test
starts lives on a network or under a compose project named after the test, and
is removed at its end; the host reaches containers only through `docker exec`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
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


class Build:
    """`deploy/docker/build` of the test image, running in the background at the
    lowest CPU and I/O priority (the tests beside it come first); its output goes to
    files, which no one need read while it runs. It is a process group of its own,
    so that stopping it stops what the script started (debootstrap, pip, docker)."""

    def __init__(self) -> None:
        self.stdout = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in `stop`)
        self.stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.process = subprocess.Popen(
            ["nice", "-n", "19", "ionice", "-c", "3",
             str(ROOT / "deploy" / "docker" / "build"), "--tag", IMAGE],
            stdin=subprocess.DEVNULL, stdout=self.stdout, stderr=self.stderr, text=True,
            start_new_session=True)

    def wait(self, timeout: float = 1800) -> str:
        """The image's tag once built; an assertion error with the build's output if
        it failed."""
        try:
            code = self.process.wait(timeout)
            self.stdout.seek(0)
            self.stderr.seek(0)
            out, err = self.stdout.read(), self.stderr.read()
        finally:
            self.stop()
        assert code == 0, err[-4000:]
        print(out.strip())
        return IMAGE

    def stop(self) -> None:
        """Stop the build's whole group if it still runs: SIGTERM (the script's traps
        remove its temporary folders), SIGKILL if that is not enough."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(_STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.stdout.close()
        self.stderr.close()


# How long a build stopped early has to end before it is killed.
_STOP_S = 30.0
BUILD = pytest.StashKey[Build]()


def start_build(session: pytest.Session) -> None:
    """Start the image's build now if a collected test needs it and tests will run
    (not with --collect-only, after a collection error, or on an xdist worker, where
    each worker would build its own: there the fixture builds)."""
    config = session.config
    if (config.option.collectonly or session.testsfailed or hasattr(config, "workerinput")
            or not any("image" in getattr(item, "fixturenames", ()) for item in session.items)):
        return
    config.stash[BUILD] = Build()


def stop_build(session: pytest.Session) -> None:
    """A build no test waited for (the session was cut short) is not left running."""
    build = session.config.stash.get(BUILD, None)
    if build is not None:
        build.stop()


@pytest.fixture(scope="session")
def image(request: pytest.FixtureRequest) -> str:
    """The image, built from this checkout (started at collection, `start_build`)."""
    build = request.config.stash.get(BUILD, None) or Build()
    return build.wait()


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
