"""The recorded history of a chaos run: one merged, time-ordered event log.

Every process of a run — the coordinator, each learner, the harness itself —
appends JSON objects to its own JSONL log (`protos.events.EventLog`). After
the run the harness merges them here into one list of `Event`s sorted by
time; the invariant checkers (`chaos.checkers`), the goodput/uptime metrics
(`chaos.metrics`) and the report (`chaos.report`) read only that list. Each
event keeps its position in the merged log as `index`, so a failed invariant
can name the events that broke it ("#17 coordinator push_ack ...").

A SIGKILLed process may leave a half-written last line; loading skips such a
line and counts it (`LoadedLog.skipped`) rather than failing the whole run.

The module also derives the facts several readers need from the raw events:
who the learners are, how many fragments the model has, and when each
learner (or the coordinator) was down, paused, partitioned or straggling
(`outages`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protos.contribution import ContributionId

COORDINATOR = "coordinator"
HARNESS = "harness"

# Outage causes: why a process could not make progress for a while.
DOWN = "down"
PAUSED = "paused"
PARTITIONED = "partitioned"
STRAGGLING = "straggling"  # duty-cycled SIGSTOP/SIGCONT: slowed, by its own fault


class MalformedEvent(ValueError):
    """An event lacks a field a reader needs, or holds one of the wrong type."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


@dataclass(frozen=True, slots=True)
class Event:
    """One line of the merged log. `fields` holds everything but t/source/kind."""

    index: int
    t: float
    source: str
    kind: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def has(self, key: str) -> bool:
        return key in self.fields

    def text(self, key: str) -> str:
        value = self._require(key)
        if not isinstance(value, str):
            raise MalformedEvent(f"{self.describe()}: field {key!r} is not a string: {value!r}",
                                 self.index)
        return value

    def integer(self, key: str) -> int:
        value = self._require(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise MalformedEvent(f"{self.describe()}: field {key!r} is not an integer: {value!r}",
                                 self.index)
        return value

    def number(self, key: str) -> float:
        value = self._require(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MalformedEvent(f"{self.describe()}: field {key!r} is not a number: {value!r}",
                                 self.index)
        return float(value)

    @property
    def learner(self) -> str:
        """The learner the event is about: its `learner` field, else its source."""
        value = self.fields.get("learner", self.source)
        return value if isinstance(value, str) else str(value)

    @property
    def cid(self) -> ContributionId:
        """The contribution id of a push_*/merged/dropped/init event."""
        return ContributionId(self.learner, self.integer("fragment"), self.integer("seq"))

    def manifest(self) -> list[ContributionId]:
        """The contribution ids a `commit` event merged."""
        fragment = self.integer("fragment")
        entries = self._require("manifest")
        if not isinstance(entries, list):
            raise MalformedEvent(f"{self.describe()}: manifest is not a list", self.index)
        ids = []
        for entry in entries:
            if (not isinstance(entry, dict) or not isinstance(entry.get("learner"), str)
                    or not isinstance(entry.get("seq"), int)):
                raise MalformedEvent(f"{self.describe()}: bad manifest entry {entry!r}",
                                     self.index)
            ids.append(ContributionId(entry["learner"], fragment, entry["seq"]))
        return ids

    def describe(self, t0: float | None = None) -> str:
        """`#12 t=+4.21s coordinator push_ack learner=l1 fragment=0 seq=3` (short fields)."""
        when = f"t=+{self.t - t0:.2f}s" if t0 is not None else f"t={self.t:.3f}"
        shown = [f"{k}={v}" for k, v in self.fields.items()
                 if isinstance(v, str | int | float) and not isinstance(v, bool)
                 and len(str(v)) <= 40]
        return " ".join([f"#{self.index}", when, self.source, self.kind, *shown])

    def _require(self, key: str) -> Any:
        if key not in self.fields:
            raise MalformedEvent(f"{self.describe()}: missing field {key!r}", self.index)
        return self.fields[key]


# -- loading -------------------------------------------------------------------------


@dataclass(frozen=True)
class SkippedLine:
    """A line that did not parse (typically cut short by a SIGKILL)."""

    path: str
    line: int
    text: str
    reason: str


@dataclass(frozen=True)
class LoadedLog:
    events: list[Event]
    skipped: list[SkippedLine]


def load_log(paths: Iterable[str | Path]) -> LoadedLog:
    """Merge the JSONL logs at `paths` into one list sorted by time.

    Ties keep file order (path by path, line by line). A line may sort ahead
    of lines its process wrote before it: a commit's line carries the time of
    its publication, a little before the line was written.
    A line that is not a JSON object with a numeric "t" and string
    "source"/"kind" is skipped and reported. A restarted process
    appending to the log its killed predecessor cut short produces a line
    holding the broken tail and then a whole record; the whole record is
    kept.
    """
    records: list[dict[str, Any]] = []
    skipped: list[SkippedLine] = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as lines:
            for number, raw in enumerate(lines, start=1):
                line = raw.strip()
                if not line:
                    continue
                record, reason = _parse(line)
                if record is None and reason.startswith("not JSON"):
                    start = line.rfind('{"t"')
                    if start > 0:
                        record, _ = _parse(line[start:])
                        if record is not None:
                            skipped.append(SkippedLine(str(path), number, line[:start][:200],
                                                       "truncated record before a whole one"))
                            reason = ""
                if record is None:
                    skipped.append(SkippedLine(str(path), number, line[:200], reason))
                    continue
                records.append(record)
    return LoadedLog(events_from_records(records), skipped)


def load_events(paths: Iterable[str | Path]) -> list[Event]:
    """`load_log(paths).events`: the merged events, skipped lines dropped."""
    return load_log(paths).events


def events_from_records(records: Iterable[Mapping[str, Any]]) -> list[Event]:
    """Events from decoded records (stable-sorted by "t"), indexed by position."""
    ordered = sorted(records, key=lambda r: float(r["t"]))
    return [Event(i, float(r["t"]), str(r["source"]), str(r["kind"]),
                  {k: v for k, v in r.items() if k not in ("t", "source", "kind")})
            for i, r in enumerate(ordered)]


def write_events(events: Iterable[Event], path: str | Path) -> None:
    """Write `events` as one merged JSONL log (the inverse of `load_events`)."""
    with open(path, "w", encoding="utf-8") as out:
        for event in events:
            record = {"t": event.t, "source": event.source, "kind": event.kind, **event.fields}
            out.write(json.dumps(record, separators=(",", ":")) + "\n")


def _parse(line: str) -> tuple[dict[str, Any] | None, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg})"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    t = record.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        return None, "no numeric 't'"
    if not isinstance(record.get("source"), str) or not isinstance(record.get("kind"), str):
        return None, "no string 'source' or 'kind'"
    return record, ""


# -- facts derived from the history ----------------------------------------------------


def run_bounds(events: Sequence[Event]) -> tuple[float, float]:
    """(start, end): the harness's run_start/run_end, else the first/last event."""
    if not events:
        return 0.0, 0.0
    start = next((e.t for e in events if e.kind == "run_start" and e.source == HARNESS),
                 events[0].t)
    end = next((e.t for e in reversed(events) if e.kind == "run_end" and e.source == HARNESS),
               events[-1].t)
    return start, max(start, end)


def run_info(events: Sequence[Event]) -> dict[str, Any]:
    """The harness's run_start fields (experiment, seed, mode, learners), or {}."""
    for e in events:
        if e.kind == "run_start" and e.source == HARNESS:
            return dict(e.fields)
    return {}


def adversary_ids(events: Sequence[Event]) -> set[str]:
    """Names of the harness's adversary processes (they push as learners do)."""
    return {str(e.get("name")) for e in events if e.source == HARNESS
            and e.kind == "process_start" and e.get("role") == "adversary"} | {
        str(e.get("target")) for e in events if e.source == HARNESS and e.kind == "fault"
        and e.get("fault") == "adversary"}


def learner_ids(events: Sequence[Event]) -> list[str]:
    """Learners of the run: run_start's list, learner processes and the sources
    of other events — adversaries excluded."""
    found: dict[str, None] = {}
    learners = run_info(events).get("learners")
    if isinstance(learners, list):
        found.update((str(lid), None) for lid in learners)
    for e in events:
        if e.kind == "process_start" and e.source == HARNESS and e.get("role") == "learner":
            found[str(e.get("name"))] = None
        elif e.source not in (COORDINATOR, HARNESS):
            found[e.source] = None
    adversaries = adversary_ids(events)
    return sorted(lid for lid in found if lid not in adversaries)


def fragment_count(events: Sequence[Event]) -> int:
    """P: run_start's `fragments` if given, else the most any event shows."""
    given = run_info(events).get("fragments")
    if isinstance(given, int) and given > 0:
        return given
    count = 0
    for e in events:
        fragment = e.get("fragment")
        if isinstance(fragment, int) and not isinstance(fragment, bool):
            count = max(count, fragment + 1)
        versions = e.get("versions")
        if e.kind in ("join", "resume") and isinstance(versions, dict):
            for key in versions:
                if str(key).lstrip("-").isdigit():
                    count = max(count, int(key) + 1)
    return count


def versions_of(event: Event) -> dict[int, int]:
    """A resume/join event's `versions` map with integer keys (JSON made them strings)."""
    raw = event.get("versions")
    if not isinstance(raw, dict):
        raise MalformedEvent(f"{event.describe()}: field 'versions' is not an object",
                             event.index)
    try:
        return {int(k): int(v) for k, v in raw.items()}
    except (TypeError, ValueError) as exc:
        raise MalformedEvent(f"{event.describe()}: bad versions {raw!r}",
                             event.index) from exc


def stale_exits(events: Sequence[Event]) -> set[int]:
    """Indices of process_exit events of a process already replaced.

    The harness may log a killed process's exit after it logged its
    replacement's start; when both carry `pid`, such an exit says nothing
    about the process now running under that name.
    """
    current: dict[str, Any] = {}
    stale = set()
    for e in events:
        if e.source != HARNESS:
            continue
        if e.kind == "process_start":
            current[str(e.get("name"))] = e.get("pid")
        elif e.kind == "process_exit":
            running = current.get(str(e.get("name")))
            if e.get("pid") is not None and running is not None and e.get("pid") != running:
                stale.add(e.index)
    return stale


@dataclass(frozen=True)
class Outage:
    """A stretch in which `target` could not work normally: killed/exited
    (down), SIGSTOPped (paused), cut off (partitioned) or duty-cycled
    (straggling). `end` is None if it never healed; `end_index` names the
    event that healed it."""

    target: str
    cause: str
    start: float
    start_index: int
    end: float | None = None
    end_index: int | None = None


def outages(events: Sequence[Event]) -> list[Outage]:
    """Every outage of every learner and of the coordinator, in start order.

    Down opens at kill_learner/restart_learner (or kill/restart_coordinator)
    faults or a process_exit; it closes at the process's next process_start,
    a `heal` of the kill (the harness's restart), or — should the harness not
    log starts — the learner's own next `join` (the coordinator's next
    `resume`). Pause, partition and straggle open at their fault's `inject`
    and close at its `heal`.
    """
    coordinator_names = {COORDINATOR}
    learners = set(learner_ids(events))
    for e in events:
        if e.kind == "process_start" and e.get("role") == COORDINATOR:
            coordinator_names.add(str(e.get("name")))

    stale = stale_exits(events)
    open_: dict[tuple[str, str], Outage] = {}
    done: list[Outage] = []

    def opening(target: str, cause: str, e: Event) -> None:
        if (target, cause) not in open_:
            open_[(target, cause)] = Outage(target, cause, e.t, e.index)

    def closing(target: str, cause: str, e: Event) -> None:
        outage = open_.pop((target, cause), None)
        if outage is not None:
            done.append(Outage(target, cause, outage.start, outage.start_index, e.t, e.index))

    def process(name: str) -> str | None:
        if name in coordinator_names:
            return COORDINATOR
        return name if name in learners else None

    for e in events:
        if e.source == HARNESS and e.kind in ("process_start", "process_exit"):
            target = process(str(e.get("name"))) if e.index not in stale else None
            if target is not None:
                (closing if e.kind == "process_start" else opening)(target, DOWN, e)
        elif e.source == HARNESS and e.kind == "fault":
            fault, action = str(e.get("fault")), str(e.get("action", "inject"))
            target = COORDINATOR if fault.endswith("_coordinator") else str(e.get("target"))
            cause = {"kill_learner": DOWN, "restart_learner": DOWN, "kill_coordinator": DOWN,
                     "restart_coordinator": DOWN, "pause_learner": PAUSED,
                     "partition_learner": PARTITIONED, "partition": PARTITIONED,
                     "straggle": STRAGGLING}.get(fault)
            if cause is None:
                continue
            if action == "heal":
                closing(target, cause, e)
            else:
                opening(target, cause, e)
        elif e.kind == "join" and e.source in learners:
            closing(e.source, DOWN, e)
        elif e.kind == "resume" and e.source == COORDINATOR:
            closing(COORDINATOR, DOWN, e)
    done.extend(open_.values())
    return sorted(done, key=lambda o: (o.start, o.start_index))
