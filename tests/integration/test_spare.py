"""Warm spares against a real daemon: a spare refuses a bad hand-over and goes on
waiting, takes a good one and trains as that learner; `ftsync-learner supervise`
and the chaos harness (`spares = 1`) replace a SIGKILLed learner with a spare,
whose contributions merge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from learner.spare import Spare
from tests.daemon import Daemon, wait_until
from tests.integration.test_chaos_faults import experiment_text, run


def _merged_by(log: Path, learner_id: str) -> list[tuple[int, int]]:
    """(fragment, seq) of every contribution of `learner_id` in a commit manifest."""
    merged = []
    for line in log.read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "commit":
            merged += [(event["fragment"], c["seq"]) for c in event["manifest"]
                       if c["learner"] == learner_id]
    return merged


def _events(path: Path, kind: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["kind"] == kind]


def test_spare_refuses_bad_handovers_then_trains_as_the_slot(tmp_path: Path) -> None:
    log = tmp_path / "coordinator.events.jsonl"
    daemon = Daemon(state_dir=tmp_path / "state",
                    args=["--event-log", str(log), "--set", "fsync=false"]).start()
    lines: list[str] = []
    codes: list[int] = []
    build = ["--task", "digits", "--size", "tiny", "--threads", "1"]
    spare = Spare([*build, "--coordinator", daemon.address])
    try:
        assert spare.ready.wait(120), "the spare never said it was warm"
        events = tmp_path / "slot.events.jsonl"
        slot = [*build, "--coordinator", daemon.address, "--learner-id", "slot-1",
                "--shard", "1", "--num-shards", "2", "--steps", "30", "--sync-every", "8",
                "--fragments", "2", "--progress-every", "10", "--event-log", str(events)]
        assert spare.process.stdin is not None
        for bad in ("not json\n", '{"flags": []}\n', '{"args": [1, 2]}\n'):
            spare.process.stdin.write(bad)
        spare.process.stdin.flush()
        # A slot whose model is another one than the spare built: refused, by flag.
        spare.hand_over([*slot, "--size", "small"], lines.append, codes.append)
        wait_until(lambda: len(spare.refusals) == 4, timeout=30, message="four refusals")
        assert spare.refusals[0].startswith("not JSON")
        assert "--size 'small' differs" in spare.refusals[3]
        assert spare.alive and not _events(events, "join"), "a refusal changed something"
        spare.hand_over(slot, lines.append, codes.append)
        wait_until(lambda: codes, timeout=120, message="the spare's run to end")
        assert codes == [0], "".join(lines)
        assert any(line.startswith("ftsync-spare: taking the slot of slot-1") for line in lines)
        assert _events(events, "join"), "the spare did not join as the slot"
        assert _merged_by(log, "slot-1"), "no contribution of the spare was merged"
    finally:
        spare.process.kill()
        daemon.stop()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def _is_spare(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"--spare" in f.read().split(b"\0")
    except FileNotFoundError:
        return False


def _spares_of(address: str) -> list[int]:
    """Spare processes started for the daemon at `address`, wherever they are."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _is_spare(int(entry.name)):
            try:
                if address.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except FileNotFoundError:
                continue
    return found


def test_supervise_hands_a_killed_learners_slot_to_its_spare(tmp_path: Path) -> None:
    log = tmp_path / "coordinator.events.jsonl"
    daemon = Daemon(state_dir=tmp_path / "state",
                    args=["--event-log", str(log), "--set", "fsync=false"]).start()
    events = tmp_path / "learner.events.jsonl"
    flags = ["--task", "synthetic", "--coordinator", daemon.address, "--learner-id", "solo",
             "--steps", "400", "--step-ms", "10", "--sync-every", "10", "--fragments", "2",
             "--progress-every", "10", "--event-log", str(events)]
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "learner", "supervise", "--spares", "1", "--", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until(lambda: _merged_by(log, "solo"), timeout=60, message="a first merge")
        learner = next(pid for pid in _children(supervisor.pid) if not _is_spare(pid))
        wait_until(lambda: any(_is_spare(pid) for pid in _children(supervisor.pid)),
                   timeout=30, message="a spare process")
        os.kill(learner, signal.SIGKILL)
        output, _ = supervisor.communicate(timeout=120)
        assert supervisor.returncode == 0, output
        assert "ftsync-learner supervise: the learner exited -9" in output, output
        assert "ftsync-spare: taking the slot of solo" in output, output
        joins = _events(events, "join")
        assert len(joins) == 2, joins
        after = [e for e in _events(events, "push_invoke") if e["t"] > joins[1]["t"]]
        merged = set(_merged_by(log, "solo"))
        assert any((e["fragment"], e["seq"]) in merged for e in after), \
            "no contribution of the spare merged"
        # The spare warmed after the hand-over ended with the supervisor.
        wait_until(lambda: not _spares_of(daemon.address), timeout=30,
                   message="the supervisor's spares to end")
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        daemon.stop()


@pytest.mark.slow  # a whole experiment, as the other fault kinds' runs
def test_harness_hands_a_killed_learners_slot_to_a_warm_spare(tmp_path: Path) -> None:
    text = experiment_text("kill_learner").replace("peers = true", "peers = true\nspares = 1")
    events, summary = run(tmp_path, "spare", text)
    assert all(check["passed"] for check in summary["checks"]), summary["checks"]
    kill = [e for e in events if e["kind"] in ("fault", "fault_skipped")
            and e["fault"] == "kill_learner"]
    assert [(e["kind"], e["action"]) for e in kill] == [
        ("fault", "inject"), ("fault", "heal"), ("fault_skipped", "heal")], kill
    assert "spare" in kill[1]["detail"] and "spare" in kill[2]["reason"]
    starts = [e for e in events if e["kind"] == "process_start" and e["name"] == "learner-0"]
    # The fault schedule started once the spare was warm.
    assert len(starts) == 2 and starts[1].get("spare") is True and starts[1]["warm"], starts
    # A new spare warms as soon as one is handed a slot.
    assert len([e for e in events if e["kind"] == "spare_start"]) == 2
    # (On a loaded machine the first process may be killed before it joined.)
    joined = next(e for e in events if e["kind"] == "join" and e["source"] == "learner-0"
                  and e["t"] > starts[1]["t"])
    pushed = {(e["fragment"], e["seq"]) for e in events if e["kind"] == "push_invoke"
              and e["source"] == "learner-0" and e["t"] > joined["t"]}
    merged = {(e["fragment"], c["seq"]) for e in events if e["kind"] == "commit"
              for c in e["manifest"] if c["learner"] == "learner-0"}
    assert pushed & merged, "no contribution of the spare was merged"
    for spare in (e for e in events if e["kind"] == "spare_start"):
        wait_until(lambda pid=spare["pid"]: not Path(f"/proc/{pid}").exists()
                   or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(),
                   timeout=10, message=f"spare {spare['pid']} to end with the run")
