"""The event log of coordinators and learners: one JSON object per line.

Joins, leaves, pushes (invoked, acknowledged, rejected with reason),
commits with their manifests, pulls. The chaos harness merges the logs of
every process to check exactly-once and liveness invariants after a run,
so both sides write the same format through this one class, and every
kind of event is declared below with its fields (`SCHEMA`, `problems`).
"""

from __future__ import annotations

import json
import time
import types
from collections.abc import Mapping
from pathlib import Path
from typing import (
    Any,
    Literal,
    NotRequired,
    TextIO,
    TypedDict,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)


class EventLog:
    """Appends events to a file, or drops them when no path is configured."""

    def __init__(self, path: str, source: str = "coordinator") -> None:
        self.source = source
        self._out: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._out = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the log)

    def emit(self, kind: str, t: float | None = None, **fields: Any) -> None:
        """Log `kind` at wall time `t`: now, unless the fact took effect earlier (a
        process stopped between doing something and logging it logs when it did it)."""
        if self._out is None:
            return
        record = {"t": time.time() if t is None else t, "source": self.source, "kind": kind,
                  **fields}
        self._out.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None


# -- the schema ------------------------------------------------------------------
#
# Each event kind is a declared type with its fields, as the line reads once decoded
# (JSON object keys are strings: a `versions` map of fragment to version has string
# keys). `t`, `source` and `kind` are on every line and not repeated. The checkers,
# the report and any reader outside this repository rely on these names; a test runs
# experiments and validates every line they wrote against the schema, so a field added
# at an emit site and not here fails it.

Source = Literal["coordinator", "learner", "harness"]
Versions = dict[str, int]
# A contribution as a commit's manifest lists it.
ManifestEntry = dict[str, Any]


class Join(TypedDict):
    learner: str
    host: str
    pid: int
    next_seq: int


class Init(TypedDict):
    learner: str
    fragment: int
    seq: int


class PushStaged(TypedDict):
    learner: str
    fragment: int
    seq: int
    waited_s: float


class PushAck(TypedDict):
    learner: str
    fragment: int
    seq: int
    base_version: int
    weight: float
    staleness: int
    target: int
    replaces: NotRequired[int]


class PushCut(TypedDict):
    """Cut before its header arrived, it names no learner."""
    learner: NotRequired[str]
    fragment: NotRequired[int]
    seq: NotRequired[int]
    reason: NotRequired[str]


class Reject(TypedDict):
    rpc: str
    learner: str
    reason: str
    message: str
    fragment: NotRequired[int]
    seq: NotRequired[int]
    base_version: NotRequired[int]


class Commit(TypedDict):
    fragment: int
    version: int
    manifest: list[ManifestEntry]
    quorum_wait_s: float
    grace_s: float
    sync_s: float
    why: str
    # The quorum the round needed and the outer step's scale (`RoundClose`); with
    # policy.min_quorum = "auto", what the quorum was chosen from (`QuorumChoice`).
    quorum: int
    step_scale: float
    noise_ratio: NotRequired[float | None]
    cycles_s: NotRequired[list[float]]
    fixed_s: NotRequired[float]
    epoch: NotRequired[int]


class SyncEvery(TypedDict):
    """A learner that takes its H from the coordinator was assigned another
    (`SyncEveryChoice`): its step time, the period every such learner is fitted to,
    the bounds, and the H before (0: its first)."""

    learner: str
    sync_every: int
    previous: int
    step_s: float | None
    period_s: float | None
    h_min: int
    h_max: int


class CommitAbandoned(TypedDict):
    fragment: int
    version: int
    epoch: int
    reason: str


class Leave(TypedDict):
    learner: str
    reason: str


class Resume(TypedDict):
    run_id: str
    versions: Versions


class StateRegressed(TypedDict):
    """A fragment's file found older than the manifest log's last record of it
    (`version` -1: no file); the versions after `version` are lost."""
    fragment: int
    version: int
    logged_version: int
    logged_epoch: int


class Elected(TypedDict):
    replica: str
    epoch: int
    run_id: str
    versions: Versions


class StepDown(TypedDict):
    replica: str
    epoch: int
    reason: str


class Replicated(TypedDict):
    """As `ReplicaHeader` names them: `epoch` is the sending leader's, `commit_epoch`
    the epoch the version was committed in."""
    fragment: int
    version: int
    epoch: int
    commit_epoch: int


class Drain(TypedDict):
    replica: str
    role: str


class Drained(TypedDict):
    replica: str
    committed: int
    left_open: list[int]


class ReplicaReason(TypedDict):
    """`drain_abandoned`."""
    replica: str
    reason: str


class StandingBy(TypedDict):
    replica: str
    run_id: str
    reason: str


class Fatal(TypedDict):
    reason: str


class InSync(TypedDict):
    epoch: int
    replicas: list[str]


class StandbyInSync(TypedDict):
    replica: str
    epoch: int


class StandbyLagging(TypedDict):
    replica: str
    fragment: int
    version: int


class StandbyLost(TypedDict):
    replica: str
    error: str


class StandbyBulkFallback(TypedDict):
    """A standby's bulk port could not be reached from the leader: the versions it
    replicates there go as gRPC chunks."""
    replica: str
    address: str
    error: str


class LearnerJoin(TypedDict):
    learner: str
    run_id: str
    versions: Versions
    coordinator: str
    epoch: int


class Redirect(TypedDict):
    learner: str
    source_address: str
    to: str


class BulkFallback(TypedDict):
    """The coordinator's bulk port could not be reached: its transfers go as gRPC chunks."""
    learner: str
    coordinator: str
    error: str


class PushInvoke(TypedDict):
    learner: str
    fragment: int
    seq: int
    base_version: int
    c_steps: int
    work_s: float


class LearnerPushAck(TypedDict):
    learner: str
    fragment: int
    seq: int
    target: int
    weight: float
    staleness: int


class PushUnsent(TypedDict):
    learner: str
    fragment: int
    seq: int
    error: str


class Merged(TypedDict):
    learner: str
    fragment: int
    seq: int


class Dropped(TypedDict):
    """Refused (`seq`, `detail`) or never sent (`work_s`: the work it carried)."""
    learner: str
    fragment: int
    reason: str
    seq: NotRequired[int]
    detail: NotRequired[str]
    work_s: NotRequired[float]


class Rewound(TypedDict):
    learner: str
    fragment: int
    had_version: int
    version: int


class CatchUpEvent(TypedDict):
    learner: str
    versions: Versions
    sources: dict[str, str]
    seconds: float
    bytes_from_peers: int
    bytes_from_coordinator: int
    misses: list[str]


class Applied(TypedDict):
    learner: str
    fragment: int
    version: int
    step: int


class PullFallback(TypedDict):
    learner: str
    fragment: int
    step: int
    base_version: int


class VersionLost(TypedDict):
    """`had_commit` and `commit` are commit ids in hex."""
    learner: str
    fragment: int
    version: int
    had_commit: str
    commit: str


class LearnerError(TypedDict):
    """`heartbeat_failed`."""
    learner: str
    error: str


class FragmentError(TypedDict):
    """`pull_failed`, `push_failed`."""
    learner: str
    fragment: int
    error: str


class PullTimeout(TypedDict):
    learner: str
    fragment: int
    have_version: int


class PeerServe(TypedDict):
    learner: str
    to: str
    fragment: int
    version: int
    transport: str
    bytes: int
    seconds: float


class PeerRefused(TypedDict):
    """A bulk connection to this learner's peer port with a bad ticket."""
    learner: str
    reason: str
    message: str


class Train(TypedDict):
    learner: str
    step: int
    loss: float
    tokens: int


class Eval(TypedDict):
    learner: str
    step: int
    loss: float


class TrainEnd(TypedDict):
    learner: str
    step: int
    reason: str


class FlowerFit(TypedDict):
    """`fit` counts a Flower client's fits from 1 (Flower's `server-round`)."""
    learner: str
    fit: int
    num_examples: int
    fit_s: float
    applied: list[int]
    versions: Versions
    metrics: dict[str, Any]


class FlowerNoExamples(TypedDict):
    learner: str
    fit: int


class FlowerEvaluate(TypedDict):
    """`fit`: after that many fits (0: on the initial global values)."""
    learner: str
    fit: int
    loss: float
    metrics: dict[str, Any]


class Adversary(TypedDict):
    """One attack of `chaos.adversary`; a refused one carries the status code."""
    learner: str
    attack: str
    fragment: int
    seq: int
    accepted: bool
    code: NotRequired[str]
    message: NotRequired[str]


class RunStart(TypedDict):
    experiment: str
    seed: int
    mode: str
    learners: list[str]
    fragments: int


class RunReason(TypedDict):
    """`run_stop`, `run_end`."""
    reason: str


class ProcessStart(TypedDict):
    role: str
    name: str
    pid: int | None
    container: NotRequired[str]
    # A warm spare took the slot (learner/spare.py); `warm`: it had said ready.
    spare: NotRequired[bool]
    warm: NotRequired[bool]


class SpareStart(TypedDict):
    pid: int


class ProcessExit(TypedDict):
    name: str
    code: int
    pid: int | None
    container: NotRequired[str]


class Fault(TypedDict):
    fault: str
    target: str
    action: Literal["inject", "heal"]
    detail: str
    epoch: NotRequired[int]
    cut_from: NotRequired[list[str]]
    took_s: NotRequired[float]


class FaultSkipped(TypedDict):
    fault: str
    target: str
    action: Literal["inject", "heal"]
    reason: str


class FaultNote(TypedDict):
    target: str
    note: str


class Leader(TypedDict):
    replica: str
    epoch: int


class TopologyReady(TypedDict):
    waiting_for: list[str]


SCHEMA: dict[tuple[Source, str], type] = {
    ("coordinator", "join"): Join,
    ("coordinator", "init"): Init,
    ("coordinator", "push_staged"): PushStaged,
    ("coordinator", "push_ack"): PushAck,
    ("coordinator", "push_cut"): PushCut,
    ("coordinator", "reject"): Reject,
    ("coordinator", "commit"): Commit,
    ("coordinator", "commit_abandoned"): CommitAbandoned,
    ("coordinator", "sync_every"): SyncEvery,
    ("coordinator", "leave"): Leave,
    ("coordinator", "resume"): Resume,
    ("coordinator", "state_regressed"): StateRegressed,
    ("coordinator", "elected"): Elected,
    ("coordinator", "step_down"): StepDown,
    ("coordinator", "replicated"): Replicated,
    ("coordinator", "drain"): Drain,
    ("coordinator", "drained"): Drained,
    ("coordinator", "drain_abandoned"): ReplicaReason,
    ("coordinator", "standing_by"): StandingBy,
    ("coordinator", "fatal"): Fatal,
    ("coordinator", "insync"): InSync,
    ("coordinator", "standby_in_sync"): StandbyInSync,
    ("coordinator", "standby_lagging"): StandbyLagging,
    ("coordinator", "standby_lost"): StandbyLost,
    ("coordinator", "bulk_fallback"): StandbyBulkFallback,
    ("learner", "join"): LearnerJoin,
    ("learner", "redirect"): Redirect,
    ("learner", "bulk_fallback"): BulkFallback,
    ("learner", "push_invoke"): PushInvoke,
    ("learner", "push_ack"): LearnerPushAck,
    ("learner", "push_unsent"): PushUnsent,
    ("learner", "merged"): Merged,
    ("learner", "dropped"): Dropped,
    ("learner", "rewound"): Rewound,
    ("learner", "catch_up"): CatchUpEvent,
    ("learner", "applied"): Applied,
    ("learner", "pull_fallback"): PullFallback,
    ("learner", "version_lost"): VersionLost,
    ("learner", "heartbeat_failed"): LearnerError,
    ("learner", "pull_failed"): FragmentError,
    ("learner", "push_failed"): FragmentError,
    ("learner", "pull_timeout"): PullTimeout,
    ("learner", "peer_serve"): PeerServe,
    ("learner", "peer_refused"): PeerRefused,
    ("learner", "train"): Train,
    ("learner", "eval"): Eval,
    ("learner", "train_end"): TrainEnd,
    ("learner", "flower_fit"): FlowerFit,
    ("learner", "flower_no_examples"): FlowerNoExamples,
    ("learner", "flower_evaluate"): FlowerEvaluate,
    ("learner", "adversary"): Adversary,
    ("harness", "run_start"): RunStart,
    ("harness", "run_stop"): RunReason,
    ("harness", "run_end"): RunReason,
    ("harness", "process_start"): ProcessStart,
    ("harness", "process_exit"): ProcessExit,
    ("harness", "fault"): Fault,
    ("harness", "fault_skipped"): FaultSkipped,
    ("harness", "fault_note"): FaultNote,
    ("harness", "leader"): Leader,
    ("harness", "topology_ready"): TopologyReady,
    ("harness", "spare_start"): SpareStart,
}


def source_class(source: str) -> Source:
    """The daemon writes `coordinator` and the harness `harness`; anything else is a
    learner's id."""
    if source in ("coordinator", "harness"):
        return source  # type: ignore[return-value]
    return "learner"


def problems(record: Mapping[str, Any]) -> list[str]:
    """What is wrong with one decoded event line against `SCHEMA`; empty when valid."""
    missing = [key for key in ("t", "source", "kind") if key not in record]
    if missing:
        return [f"missing {', '.join(missing)}"]
    kind, source = record["kind"], record["source"]
    if not isinstance(source, str) or not isinstance(kind, str):
        return ["source and kind must be strings"]
    declared = SCHEMA.get((source_class(source), kind))
    if declared is None:
        return [f"{source_class(source)} event {kind!r} is not declared in protos/events.py"]
    declared_fields = _fields(declared)
    fields = {k: v for k, v in record.items() if k not in ("t", "source", "kind")}
    found = [f"{kind}: missing field {key!r}"
             for key, (_, required) in declared_fields.items() if required and key not in fields]
    for key, value in fields.items():
        if key not in declared_fields:
            found.append(f"{kind}: undeclared field {key!r}")
        elif not _conforms(value, declared_fields[key][0]):
            expected = declared_fields[key][0]
            found.append(f"{kind}: field {key!r} = {value!r:.80} is not {_name(expected)}")
    return found


def _fields(declared: type) -> dict[str, tuple[Any, bool]]:
    """Each field's type and whether it is required. Read from the annotations, since
    under postponed evaluation TypedDict cannot see `NotRequired` itself."""
    fields = {}
    for key, hint in get_type_hints(declared, include_extras=True).items():
        optional = get_origin(hint) is NotRequired
        fields[key] = (get_args(hint)[0] if optional else hint, not optional)
    return fields


def _conforms(value: Any, expected: Any) -> bool:
    """Whether decoded JSON `value` is of the declared type: the few forms the schema
    uses (scalars, Literal, unions with None, list[X], dict[str, X], Any)."""
    if expected is Any:
        return True
    origin, args = get_origin(expected), get_args(expected)
    if origin is Literal:
        return value in args
    if origin in (Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _conforms(v, args[1]) for k, v in value.items())
    if expected is type(None):
        return value is None
    if expected is float:  # JSON writes 2.0 as 2.0 but a float field may hold an int
        return isinstance(value, int | float) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


def _name(expected: Any) -> str:
    if get_origin(expected) is None:
        return getattr(expected, "__name__", str(expected))
    return str(expected).replace("typing.", "")
