"""The event schema (`protos.events`): what it refuses, and that the guide lists
every declared kind. The experiments' tests validate every line real runs write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protos.events import SCHEMA, EventLog, problems

ROOT = Path(__file__).resolve().parents[2]

PUSH_ACK = {"t": 1.0, "source": "coordinator", "kind": "push_ack", "learner": "l0",
            "fragment": 0, "seq": 3, "base_version": 2, "weight": 1.5, "staleness": 0,
            "target": 3}


def test_a_line_the_daemon_writes_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path))
    log.emit("push_ack", **{k: v for k, v in PUSH_ACK.items() if k not in ("t", "source", "kind")},
             replaces=2)
    log.close()
    (record,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert problems(record) == []


@pytest.mark.parametrize(("change", "expected"), [
    ({"seq": "3"}, "push_ack: field 'seq' = '3' is not int"),
    ({"seq": True}, "push_ack: field 'seq' = True is not int"),
    ({"weight": None}, "push_ack: field 'weight' = None is not float"),
    ({"replaced": 2}, "push_ack: undeclared field 'replaced'"),
    ({"kind": "push_acked"}, "coordinator event 'push_acked' is not declared in protos/events.py"),
    ({"source": "l0"}, "push_ack: undeclared field 'base_version'"),
])
def test_a_wrong_line_is_named(change: dict[str, object], expected: str) -> None:
    assert expected in problems({**PUSH_ACK, **change})


def test_missing_fields_and_envelope_are_named() -> None:
    record = {k: v for k, v in PUSH_ACK.items() if k != "target"}
    assert problems(record) == ["push_ack: missing field 'target'"]
    assert problems({"kind": "push_ack"}) == ["missing t, source"]


def test_optional_fields_literals_and_nested_types() -> None:
    fault = {"t": 1.0, "source": "harness", "kind": "fault", "fault": "partition",
             "target": "learner-0", "action": "inject", "detail": ""}
    assert problems(fault) == []
    assert problems({**fault, "cut_from": ["coordinator"], "took_s": 0.5}) == []
    assert problems({**fault, "action": "zap"}) == [
        "fault: field 'action' = 'zap' is not Literal['inject', 'heal']"]
    assert problems({**fault, "cut_from": [1]})[0].startswith("fault: field 'cut_from'")
    start = {"t": 1.0, "source": "harness", "kind": "process_start", "role": "learner",
             "name": "learner-0", "pid": None}
    assert problems(start) == []


def test_the_guide_lists_every_declared_event_kind() -> None:
    guide = (ROOT / "docs" / "architecture.md").read_text()
    section = guide.split("## The event log", 1)[1].split("\n## ", 1)[0]
    missing = sorted({kind for _, kind in SCHEMA if f"`{kind}`" not in section})
    assert not missing, f"docs/architecture.md's event log section omits {missing}"
