"""`ftsync-learner` as a user runs it: flags it cannot train with are refused
by name before it connects, and SIGTERM or SIGINT end the run with a Leave
and a summary."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from chaos.proxy import ThreadedProxy
from tests.daemon import Daemon, wait_until


def learner(*args: str) -> list[str]:
    return [sys.executable, "-m", "learner", "--coordinator", "127.0.0.1:9", *args]


@pytest.mark.parametrize(("args", "needles"), [
    (["--progress-every", "0"], ["--progress-every", "at least 1"]),
    (["--step-ms", "-1"], ["--step-ms", "at least 0"]),
    (["--threads", "0"], ["--threads"]),
    (["--tokens", "-5"], ["--tokens"]),
    (["--batch", "-1"], ["--batch", "at least 0"]),
    (["--sync-every", "4", "--overlap", "10"], ["overlap", "at most sync_every"]),
    (["--task", "synthetic", "--dim", "16", "--fragments", "1000"], ["--fragments 1000",
                                                                      "--dim 16"]),
    (["--apply-rule", "carry", "--alpha", "0.5"], ["carry", "alpha must be 0"]),
    # The default rule carries: α blends only under the overwrite, and the error says so.
    (["--alpha", "0.5"], ["carry", "alpha must be 0", "overwrite rule"]),
    (["--apply-rule", "sideways"], ["--apply-rule", "'sideways'"]),
], ids=["progress", "step-ms", "threads", "tokens", "batch", "overlap", "fragments",
        "rule-alpha", "default-rule-alpha", "rule"])
def test_a_flag_it_cannot_train_with_is_refused_by_name(args: list[str],
                                                         needles: list[str]) -> None:
    result = subprocess.run(learner("--task", "synthetic", *args), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert all(n in result.stderr for n in needles), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("device", ["gpu", "cuda"])
def test_a_device_it_cannot_use_is_named(device: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    result = subprocess.run(learner("--task", "digits", "--size", "tiny", "--device", device),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"device {device!r}" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_the_run_with_a_leave_and_a_summary(
        start_daemon: Callable[..., Daemon], tmp_path: Path, sig: signal.Signals) -> None:
    events = tmp_path / "coordinator.jsonl"
    daemon = start_daemon("--event-log", str(events))
    process = subprocess.Popen(
        [sys.executable, "-m", "learner", "--coordinator", daemon.address, "--task",
         "synthetic", "--dim", "64", "--steps", "100000", "--step-ms", "5",
         "--progress-every", "10", "--learner-id", "stopped",
         "--event-log", str(tmp_path / "learner.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    while " step " not in line:
        assert line, process.stderr.read() if process.stderr else ""
        line = process.stdout.readline()
    process.send_signal(sig)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err[-2000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped_by"] == sig.name and summary["steps"] < 100000
    wait_until(lambda: any(json.loads(e).get("kind") == "leave"
                           for e in events.read_text().splitlines()),
               timeout=10, message="the coordinator to see the learner leave")
    left = [json.loads(e) for e in events.read_text().splitlines() if '"leave"' in e]
    assert left[0]["learner"] == "stopped" and left[0]["reason"] == sig.name
    (ended,) = [json.loads(e) for e in (tmp_path / "learner.jsonl").read_text().splitlines()
                if '"train_end"' in e]
    assert (ended["step"], ended["reason"]) == (summary["steps"], sig.name), ended


def test_an_etcd_that_names_no_leader_is_unreachable_not_a_refusal() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "learner", "--task", "synthetic", "--coordinator",
         "etcd://127.0.0.1:9/run", "--connect-timeout", "2"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr
    assert "cannot reach a coordinator at etcd://127.0.0.1:9/run" in result.stderr


def test_ctrl_c_while_joining_ends_at_once() -> None:
    process = subprocess.Popen(learner("--task", "synthetic", "--connect-timeout", "60"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert "joining 127.0.0.1:9" in process.stdout.readline()  # past imports, in the join
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=20)
    assert process.returncode == 130, err
    assert "interrupted (SIGINT) while joining 127.0.0.1:9" in err


def test_sigterm_after_the_join_while_catching_up_leaves_the_run(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """A learner stopped between its join and the end of its catch-up says Leave:
    the coordinator would otherwise count it live until its heartbeats time out."""
    events = tmp_path / "coordinator.jsonl"
    daemon = start_daemon("--event-log", str(events))
    first = subprocess.run(
        [sys.executable, "-m", "learner", "--coordinator", daemon.address, "--task",
         "synthetic", "--steps", "1", "--learner-id", "first"],
        capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr  # the run's fragments now have versions
    with socket.socket() as silent_peer:  # accepts connections (backlog), never answers
        silent_peer.bind(("127.0.0.1", 0))
        silent_peer.listen(8)
        peer = f"127.0.0.1:{silent_peer.getsockname()[1]}"
        process = subprocess.Popen(
            [sys.executable, "-m", "learner", "--coordinator", daemon.address, "--task",
             "synthetic", "--learner-id", "late", "--peers", peer],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert_sigterm_after_the_join_leaves(process, daemon, events, "late")


def test_sigterm_while_the_joins_reply_is_on_its_way_leaves_the_run(
        start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """The coordinator took the Join but its reply had not come: the learner cannot
    know it joined, and says Leave all the same."""
    events = tmp_path / "coordinator.jsonl"
    daemon = start_daemon("--event-log", str(events))
    with ThreadedProxy(daemon.address) as proxy:
        proxy.set_latency(2000)  # each way: the reply comes 2 s after the join is taken
        process = subprocess.Popen(
            [sys.executable, "-m", "learner", "--coordinator", proxy.address, "--task",
             "synthetic", "--learner-id", "distant"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert_sigterm_after_the_join_leaves(process, daemon, events, "distant")


def assert_sigterm_after_the_join_leaves(process: subprocess.Popen[str], daemon: Daemon,
                                         events: Path, learner_id: str) -> None:
    """SIGTERM `process` once the coordinator logs its join: it exits as interrupted
    while joining, and the coordinator logs its Leave and counts it not live."""
    def coordinator_events(kind: str) -> list[dict[str, object]]:
        lines = [json.loads(e) for e in events.read_text().splitlines()]
        return [e for e in lines if e["kind"] == kind and e.get("learner") == learner_id]

    wait_until(lambda: coordinator_events("join"), timeout=60, message="the join")
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "interrupted (SIGTERM) while joining" in err and "Traceback" not in err
    wait_until(lambda: coordinator_events("leave"), timeout=10, message="the Leave")
    assert not any(learner.live for learner in daemon.status().learners
                   if learner.learner_id == learner_id)
