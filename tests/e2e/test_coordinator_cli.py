"""`ftsync-coordinator` refuses what it cannot run with one line that names the
problem (no traceback) and exits 1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon import Daemon


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def start(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator", "--state-dir",
                           str(tmp_path / "state"), *args],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize(("args", "needles"), [
    (["--listen", "127.0.0.1:99999"], ["listen", "65535", "99999"]),
    (["--prometheus-listen", "localhost:99999"], ["metrics.prometheus_listen", "99999"]),
    (["--set", "limits.norm_bound=nan"], ["limits.norm_bound", "nan"]),
    (["--set", "heartbeat_interval_ms=5000000000"], ["heartbeat_interval_ms", "5000000000"]),
    (["--set", "auth.tokens_file=missing.toml"], ["auth.tokens_file", "missing.toml"]),
    (["--set", "auth.tokens.a="], ["auth.tokens", "'a'", "empty"]),
], ids=["port-range", "metrics-port", "nan-bound", "heartbeat", "tokens-file", "empty-token"])
def test_a_bad_setting_is_named_in_one_line(tmp_path: Path, args: list[str],
                                             needles: list[str]) -> None:
    result = start(tmp_path, "--listen", "127.0.0.1:0", *args)  # a later --listen wins
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ftsync-coordinator: ") and all(n in last for n in needles), last
    assert "Traceback" not in result.stderr


def test_a_busy_port_and_an_unusable_state_directory_are_named(tmp_path: Path,
                                                               busy_port: int) -> None:
    result = start(tmp_path, "--listen", f"127.0.0.1:{busy_port}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot listen on 127.0.0.1:{busy_port}" in result.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = subprocess.run([sys.executable, "-m", "coordinator", "--listen", "127.0.0.1:0",
                             "--state-dir", str(blocker / "state")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "cannot start" in result.stderr and "Not a directory" in result.stderr


def test_a_second_coordinator_on_the_same_address_does_not_start(tmp_path: Path) -> None:
    first = Daemon(state_dir=tmp_path / "state").start()
    try:
        second = start(tmp_path, "--listen", first.address)
        assert second.returncode == 1, second.stdout
        assert f"cannot listen on {first.address}" in second.stderr
    finally:
        first.stop()


def test_status_asks_for_the_admin_token_when_the_daemon_has_one(tmp_path: Path) -> None:
    config = tmp_path / "coordinator.toml"
    config.write_text('[auth]\nadmin_token = "s3cret"\n')
    daemon = Daemon(state_dir=tmp_path / "state", args=["--config", str(config)]).start()
    try:
        status = [sys.executable, "-m", "coordinator", "status", "--address", daemon.address,
                  "--once"]
        refused = subprocess.run(status, capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "FTSYNC_ADMIN_TOKEN": ""})
        assert refused.returncode == 1
        assert "refused by the coordinator" in refused.stdout and "admin token" in refused.stdout
        shown = subprocess.run([*status, "--token", "s3cret"], capture_output=True, text=True,
                               timeout=60)
        assert shown.returncode == 0, shown.stdout + shown.stderr
    finally:
        daemon.stop()
    # The banner names the setting, never the token.
    assert "s3cret" not in (tmp_path / "state.stderr.log").read_text()
