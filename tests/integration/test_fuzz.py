"""Fuzzing a live daemon (issue 15): Hypothesis drives one coordinator process with
generated and mutated messages on every RPC, and judges every answer.

One daemon serves the whole run (a start costs a second; the state it builds up over
thousands of calls is part of what is fuzzed). A Hypothesis state machine calls
`Synchronizer` (Join, Heartbeat, PushFragment, PullFragment, FetchSnapshot, Leave),
`Admin` (Status; Drain without the admin's credentials, since a drain ends the daemon),
`Replication.Replicate` and `grpc.health.v1.Health.Check` (which must say SERVING
throughout) with valid requests, valid pushes mutated
(bytes flipped, data cut or padded, chunks dropped, duplicated, swapped or renumbered,
header fields set to huge, negative or foreign values, a second header, none), wholly
random pushes, streams cut short (sent concurrently: the daemon waits half a second
for each to be cancelled before refusing it), replays of accepted contributions and
joins racing leaves. The daemon's settings close each round as soon as one contribution
arrived, so no round is open between calls and every call can be judged on its own:

- no call ends in `UNKNOWN` or `INTERNAL` (nor `UNAVAILABLE`, `CANCELLED` or a missed
  deadline: the daemon keeps serving, and it is asked to commit at the end);
- a request the model knows is valid is taken, one it knows is not is refused;
- a refusal names a reason (`reason: message`) with that reason's status code, counts
  exactly one more rejection under it, and changes no state.

*State*, as a refusal must leave it, is what Admin.Status says of the run (id, layout
hash, quorum, role, epoch, leader, replica), of each fragment (version, size, open
round, commits, merged contributions) and of each learner (contributions, local step,
backlog, step time, host). Left out, because it moves with the clock or is meant to
move with a refusal: uptime and every age, liveness, bytes in and out (a refused push's
bytes were received), and the rejection counts (checked as said above). Beyond Status
the model holds every fragment's published parameters and every learner's highest
accepted sequence number: pulls and snapshots must return exactly those parameters,
each commit must move them by exactly the contribution pushed (outer lr 1, no momentum),
and a Join must hand out the next sequence number. So a refused push that leaked into a
round's sum shows at the next commit, and one that burned its contribution id at the
next join. Learners that may be fuzzed hold tokens; an observer learner of its own
pulls the parameters the model is checked against.

Embedded, the daemon serves no `Replication` (every `Replicate` must be
`UNIMPLEMENTED`, counted nowhere); `test_replication_fuzz` fuzzes it on the leader of
a highly available run on a real etcd.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from chaos.etcd import EtcdCluster
from coordinator.durability import FragmentRecord, RunRecord
from coordinator.errors import Reason
from coordinator.policy import MAX_SEQ
from coordinator.replication import replica_messages
from coordinator.service import STATUS_CODES
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos.codec import MAX_CHUNK_BYTES, codec_for, codec_named, decode_chunk_into
from tests.daemon import Daemon, wait_until
from tests.integration.test_bad_input import (
    NUMEL,
    Metadata,
    bearer,
    contribute_and_commit,
    init,
    join,
)

# -- the run under fuzz -------------------------------------------------------------

HASH = "fuzz-layout"
NUMELS = (1000, 1, 37)
LAYOUT = pb.Layout(hash=HASH, fragments=[pb.FragmentSpec(fragment=p, numel=n)
                                         for p, n in enumerate(NUMELS)])
POOL = ("a", "b", "c", "λ-ü")
OBSERVER = "observer"
TOKENS = {learner: f"token-{i}" for i, learner in enumerate((*POOL, OBSERVER))}
ADMIN_TOKEN = "admin-token"
MAX_STALENESS = 8
# The largest seq a push can carry; one that uses it leaves its learner no next one.
LAST_SEQ = 2**64 - 1
ARGS = ("--set", "policy.grace_max_s=0", "--set", f"policy.max_staleness={MAX_STALENESS}",
        "--set", "outer.lr=1.0", "--set", "outer.momentum=0.0", "--set", "outer.adaptive=false",
        "--set", "fsync=false",
        "--set", "auth.tokens={" + ", ".join(f'"{k}"="{v}"' for k, v in TOKENS.items()) + "}",
        "--set", f'auth.admin_token="{ADMIN_TOKEN}"')
CODECS = ("fp32", "bf16", "int8", "e3m0")
RPC_TIMEOUT = 10.0

# Calls per CI run. How many steps an example takes is Hypothesis's to choose (it also
# tries ending them early, and ends them once their choices pass 6.5 kB), so the fuzzer
# runs rounds of this many examples, each from its own seed, until it made the calls.
TARGET_CALLS = 10_000
STEPS = 50
ROUND_EXAMPLES = 40
MAX_ROUNDS = 30
# One example in this many sends, once it is this many steps in, a batch of pushes
# cut short, all in flight together.
CUT_ONE_IN = 3
CUT_AFTER = 10
CUT_BATCH = 16

OK = grpc.StatusCode.OK
# Never a fair answer from the daemon: a crash in a handler, or one that stopped serving.
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
         grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
         grpc.StatusCode.DATA_LOSS}
REASONS = {reason.value: reason for reason in Reason}
HEALTH_SERVICES = ("", "ftsync.v1.Synchronizer")
SERVING = health_pb2.HealthCheckResponse.SERVING


# -- strategies ---------------------------------------------------------------------------

U64_EDGES = (2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1)
I64_EDGES = (-2**63, -2**63 + 1, -2**31, -2, 2**31, 2**53 + 1, 2**63 - 1)
u64 = st.one_of(st.integers(0, 3), st.sampled_from(U64_EDGES), st.integers(0, 2**64 - 1))
i64 = st.one_of(st.integers(-3, 3), st.sampled_from(I64_EDGES), st.integers(-2**63, 2**63 - 1))
u32 = st.one_of(st.integers(0, 3), st.sampled_from((2**31, 2**32 - 1)),
                st.integers(0, 2**32 - 1))
text = st.text(max_size=16)
# The observer is no learner the fuzzer speaks for: the model pulls through it.
# Mostly a learner of the run (Hypothesis would draw each branch of a `one_of` alike).
learner_ids = st.integers(0, 19).flatmap(
    lambda i: st.just(POOL[i % len(POOL)]) if i < 16 else
    st.sampled_from(("", "ghost")) if i < 18 else text)
# How a call authenticates: "own" and "own+junk" carry the caller's token.
CREDENTIALS = ("own",) * 12 + ("own+junk", "own+junk", "none", "wrong", "other", "no scheme")
credentials = st.sampled_from(CREDENTIALS)
metadata_keys = st.from_regex(r"\Ax-[a-z0-9_.-]{0,10}\Z").filter(lambda k: not k.endswith("-bin"))
metadata_values = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), max_size=24)
codec_values = st.one_of(st.sampled_from([codec_named(c).wire for c in CODECS]),
                         st.integers(-2**31, 2**31 - 1))
floats32 = st.floats(width=32)
# Mostly a fragment of the run.
fragments = st.integers(0, 11).flatmap(
    lambda i: st.just(i % len(NUMELS)) if i < 9 else st.just(len(NUMELS)) if i < 10 else u32)


def authenticates(learner: str, how: str) -> bool:
    return learner in TOKENS and how in ("own", "own+junk")


def metadata(data: st.DataObject, learner: str, how: str) -> Metadata:
    """What a call by `learner` sends as `how` says (see CREDENTIALS)."""
    own = TOKENS.get(learner, "nobody's")
    if how == "own":
        return bearer(own)
    if how == "own+junk":
        junk = data.draw(st.lists(st.tuples(metadata_keys, metadata_values), max_size=3))
        return (*junk, *bearer(own))
    if how == "wrong":
        return bearer(data.draw(metadata_values))
    if how == "other":
        others = [t for k, t in TOKENS.items() if k != learner]
        return bearer(others[data.draw(st.integers(0, len(TOKENS) - 1)) % len(others)])
    if how == "no scheme":
        return (("authorization", own),)
    return ()


def chunked(values: np.ndarray, codec_name: str, cuts: Sequence[int]) -> list[pb.PushMessage]:
    """`values` encoded as consecutive chunks split at `cuts`."""
    codec = codec_named(codec_name)
    bounds = [0, *sorted({c for c in cuts if 0 < c < values.size}), values.size]
    messages = []
    for start, end in itertools.pairwise(bounds):
        data, scale = codec.encode(values[start:end])
        messages.append(pb.PushMessage(chunk=pb.Chunk(offset=start, count=end - start,
                                                      scale=scale, data=data)))
    return messages


def decoded(messages: Sequence[pb.PushMessage]) -> np.ndarray:
    """The values an accepted push carried, decoded as the daemon decodes them."""
    head = messages[0].header
    codec = codec_for(head.codec)
    values = np.zeros(head.numel, np.float32)
    for message in messages[1:]:
        decode_chunk_into(message.chunk, codec, values)
    return values


def describe(request: Any) -> str:
    if isinstance(request, list):
        parts = [describe(m.header) if m.WhichOneof("kind") == "header" else
                 f"chunk(offset={m.chunk.offset}, count={m.chunk.count}, scale={m.chunk.scale}, "
                 f"{len(m.chunk.data)} bytes)" if m.WhichOneof("kind") == "chunk" else "empty"
                 for m in request[:6]]
        more = f" +{len(request) - 6}" if len(request) > 6 else ""
        return "[" + "; ".join(parts) + more + "]"
    described = text_format.MessageToString(request, as_one_line=True)
    return f"{type(request).__name__}({described[:400]})"


# -- talking to the daemon and judging it -----------------------------------------------

@dataclass
class Outcome:
    rpc: str
    request: str
    code: grpc.StatusCode
    details: str = ""
    response: Any = None

    @property
    def reason(self) -> str:
        return self.details.split(":", 1)[0]

    def __str__(self) -> str:
        return f"{self.rpc} {self.request} -> {self.code.name} {self.details[:300]!r}"


@dataclass
class Observation:
    status: pb.StatusResponse
    state: tuple[Any, ...]
    rejections: Counter[str]
    versions: tuple[int, ...]


def observed(status: pb.StatusResponse) -> Observation:
    fragments = tuple((f.fragment, f.version, f.numel, tuple(f.round_learners), f.commits,
                       f.merged_contributions) for f in status.fragments)
    learners = tuple((lr.learner_id, lr.contributions, lr.local_step, lr.backlog,
                      lr.step_time_s, lr.host) for lr in status.learners)
    state = (status.run_id, status.layout_hash, status.min_quorum, status.role, status.epoch,
             status.leader, status.replica_id, fragments, learners)
    return Observation(status, state, Counter(dict(status.rejections)),
                       tuple(int(f.version) for f in status.fragments))


class World:
    """The daemon, one channel to it, and the model the fuzzer checks it against; it
    outlives each Hypothesis example, as the daemon does."""

    def __init__(self, daemon: Daemon, digest: Callable[[], str] | None = None) -> None:
        """`digest`, if given, is part of the state too."""
        self.daemon = daemon
        self.digest = digest
        self.channel = grpc.insecure_channel(daemon.address)
        self.sync = pb_grpc.SynchronizerStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self.replication = pb_grpc.ReplicationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.members: dict[str, bool] = {}
        self.seen: dict[str, int] = {}  # highest accepted seq per learner
        self.params: list[np.ndarray | None] = [None] * len(NUMELS)
        self.accepted: collections.deque[tuple[list[pb.PushMessage], Metadata]] = (
            collections.deque(maxlen=64))
        self.calls: Counter[str] = Counter()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.history: collections.deque[str] = collections.deque(maxlen=12)
        self.steps = 0
        self.cut_batches = 0
        self.failure = ""
        self.slow_calls = 0
        self.last = self.observe()

    def close(self) -> None:
        self.channel.close()

    # -- observing ---------------------------------------------------------------------

    def status(self) -> pb.StatusResponse:
        response: pb.StatusResponse = self.admin.Status(
            pb.StatusRequest(), metadata=bearer(ADMIN_TOKEN), timeout=RPC_TIMEOUT)
        return response

    def observe(self) -> Observation:
        observation = observed(self.status())
        if self.digest is not None:
            observation.state = (*observation.state, self.digest())
        return observation

    def fail(self, message: str) -> None:
        """Fail the run, and remember why: Hypothesis replays a failing example to report
        it, which against a daemon that has moved on fails otherwise, or not at all."""
        trail = "\n  ".join(self.history)
        self.failure = self.failure or f"{message}\nlast calls, newest last:\n  {trail}"
        raise AssertionError(self.failure)

    def check(self, condition: object, message: str) -> None:
        if not condition:
            self.fail(message)

    # -- calling -----------------------------------------------------------------------

    def call(self, rpc: str, request: Any, invoke: Callable[[], Any]) -> Outcome:
        """One fuzzed call, counted; `invoke` raises `grpc.RpcError` on refusal."""
        self.calls[rpc] += 1
        described = describe(request)
        started = time.monotonic()
        try:
            outcome = Outcome(rpc, described, OK, response=invoke())
        except grpc.RpcError as error:
            failed: Any = error
            outcome = Outcome(rpc, described, failed.code(), failed.details() or "")
        if time.monotonic() - started > 0.3:
            self.slow_calls += 1
        return self.noted(outcome)

    def noted(self, outcome: Outcome) -> Outcome:
        self.history.append(str(outcome))
        said = "OK" if outcome.code == OK else outcome.reason or outcome.code.name
        self.outcomes[outcome.rpc, said] += 1
        self.check(outcome.code not in NEVER, f"the daemon answered {outcome}")
        return outcome

    def push_future(self, messages: list[pb.PushMessage], md: Metadata) -> Any:
        self.calls["PushFragment"] += 1
        return self.sync.PushFragment.future(iter(messages), metadata=md, timeout=RPC_TIMEOUT)

    def settled(self, future: Any, messages: list[pb.PushMessage]) -> Outcome:
        try:
            return self.noted(Outcome("PushFragment", describe(messages), OK,
                                      response=future.result()))
        except grpc.RpcError as error:
            failed: Any = error
            return self.noted(Outcome("PushFragment", describe(messages), failed.code(),
                                      failed.details() or ""))

    # -- judging -----------------------------------------------------------------------

    def judge(self, outcome: Outcome, expect: bool | None) -> bool:
        """Whether the call was taken; `expect` True: it must be, False: it must be
        refused, None: either. A refusal is checked here; a taken call is the
        caller's to check, and then to `rebase` on."""
        taken = outcome.code == OK
        if expect is not None and taken != expect:
            self.fail(f"expected {'success' if expect else 'a refusal'}: {outcome}")
        if not taken:
            self.refused([outcome])
        return taken

    def refused(self, outcomes: Iterable[Outcome], counted: bool = True) -> None:
        """Each outcome is a refusal naming its reason under the reason's status code;
        together they count one rejection each and leave the state as it was."""
        expected = Counter(self.last.rejections)
        for outcome in outcomes:
            self.check(outcome.code != OK, f"expected a refusal: {outcome}")
            if not counted:
                continue
            reason = REASONS.get(outcome.reason)
            self.check(reason is not None, f"a refusal that names no reason: {outcome}")
            assert reason is not None
            self.check(STATUS_CODES[reason] == outcome.code,
                       f"reason {reason.value} travels as {STATUS_CODES[reason].name}: {outcome}")
            expected[reason.value] += 1
        now = self.observe()
        self.check(now.rejections == expected,
                   f"rejections counted {dict(now.rejections - self.last.rejections)}, "
                   f"expected {dict(expected - self.last.rejections)}")
        self.check(now.state == self.last.state,
                   f"a refusal changed state:\n  before {self.last.state}\n  after  {now.state}")
        self.last = now

    def rebase(self) -> None:
        self.last = self.observe()

    # -- the model's side of accepted calls ----------------------------------------------

    def pull_params(self, fragment: int) -> tuple[pb.PullHeader, np.ndarray]:
        messages = list(self.sync.PullFragment(
            pb.PullRequest(learner_id=OBSERVER, fragment=fragment, have_version=-1),
            metadata=bearer(TOKENS[OBSERVER]), timeout=RPC_TIMEOUT))
        return assembled(messages)[0]

    def accepted_push(self, messages: list[pb.PushMessage], md: Metadata,
                      response: pb.PushResponse) -> None:
        """A push was taken: its round commits, and moves the parameters by exactly what
        it carried."""
        head = messages[0].header
        p, before = head.fragment, self.last.versions[head.fragment]
        values = decoded(messages)
        self.seen[head.learner_id] = max(self.seen.get(head.learner_id, 0), head.seq)
        self.accepted.append((messages, md))
        self.check(response.seq == head.seq, f"push answered seq {response.seq}: {head}")
        if head.init:
            self.check(before == -1 and response.target_version == 0,
                       f"an initial value for fragment {p} at version {before} was taken")
            self.params[p] = values
        else:
            self.check(response.target_version == before + 1,
                       f"push against version {before} targets {response.target_version}")
            self.check(response.staleness == before - head.base_version,
                       f"staleness {response.staleness} for base {head.base_version} at {before}")
            wait_until(lambda: self.status().fragments[p].version == before + 1,
                       timeout=RPC_TIMEOUT, interval=0.002,
                       message=f"fragment {p} to commit version {before + 1}")
            header, pulled = self.pull_params(p)
            old = self.params[p]
            assert old is not None
            expected = old - values
            tolerance = 1e-6 + 1e-6 * (np.abs(old) + np.abs(values))
            wrong = np.flatnonzero(~(np.abs(pulled - expected) <= tolerance))
            self.check(header.version == before + 1 and wrong.size == 0,
                       f"version {header.version} of fragment {p} is not the last one moved by "
                       f"the contribution pushed: elements {wrong[:5]} are "
                       f"{pulled[wrong[:5]]}, expected {expected[wrong[:5]]}")
            self.params[p] = pulled
        self.rebase()

    def check_published(self, fragment: int, header: pb.PullHeader, values: np.ndarray,
                        what: str) -> None:
        version = self.last.versions[fragment]
        model = self.params[fragment]
        self.check(header.version == version and header.numel == NUMELS[fragment]
                   and model is not None and np.array_equal(values, model),
                   f"{what} of fragment {fragment} returned version {header.version} "
                   f"(status says {version}) with parameters other than those published")

    def check_views(self, learner: str, fragments: Sequence[pb.FragmentStatus]) -> None:
        versions = tuple(int(f.version) for f in fragments)
        self.check(versions == self.last.versions,
                   f"{learner} was told versions {versions}, status says {self.last.versions}")


def assembled(messages: Sequence[pb.PullMessage]) -> list[tuple[pb.PullHeader, np.ndarray]]:
    """A pull or snapshot stream as (header, values) per fragment."""
    parts: list[tuple[pb.PullHeader, np.ndarray]] = []
    fp32 = codec_named("fp32")
    for message in messages:
        if message.WhichOneof("kind") == "header":
            parts.append((message.header, np.zeros(message.header.numel, np.float32)))
        else:
            decode_chunk_into(message.chunk, fp32, parts[-1][1])
    return parts


# -- the state machine ------------------------------------------------------------------

def mutate_layout(data: st.DataObject) -> pb.Layout:
    layout = pb.Layout()
    layout.CopyFrom(LAYOUT)
    how = data.draw(st.sampled_from(("hash", "numel", "id", "drop", "extra", "empty",
                                     "swap", "same")))
    fragments = layout.fragments
    if how == "hash":
        layout.hash = data.draw(text)
    elif how == "numel":
        fragments[data.draw(st.integers(0, len(NUMELS) - 1))].numel = data.draw(u64)
    elif how == "id":
        fragments[data.draw(st.integers(0, len(NUMELS) - 1))].fragment = data.draw(u32)
    elif how == "drop":
        del fragments[data.draw(st.integers(0, len(NUMELS) - 1))]
    elif how == "extra":
        fragments.add(fragment=len(NUMELS), numel=data.draw(u64))
    elif how == "empty":
        del fragments[:]
    elif how == "swap":
        fragments[0].fragment, fragments[1].fragment = 1, 0
    return layout


class DaemonFuzzer(RuleBasedStateMachine):
    world: ClassVar[World]

    def __init__(self) -> None:
        super().__init__()
        self.w = type(self).world
        self.local_steps = 0
        self.cut_pending = False

    def step(self) -> None:
        if self.w.failure:
            raise AssertionError(self.w.failure)
        self.w.steps += 1
        self.local_steps += 1

    # -- membership ----------------------------------------------------------------------

    @rule(data=st.data(), who=learner_ids, how=credentials)
    def join(self, data: st.DataObject, who: str, how: str) -> None:
        self.step()
        w = self.w
        layout = LAYOUT if data.draw(st.booleans()) else mutate_layout(data)
        request = pb.JoinRequest(learner_id=who, layout=layout, overlap_steps=data.draw(u32),
                                 host=data.draw(text), pid=data.draw(u32), device=data.draw(text))
        md = metadata(data, who, how)
        outcome = w.call("Join", request, lambda: w.sync.Join(request, metadata=md,
                                                              timeout=RPC_TIMEOUT))
        if w.judge(outcome, authenticates(who, how) and layout == LAYOUT):
            self.joined(who, outcome.response)

    def joined(self, who: str, response: pb.JoinResponse) -> None:
        w = self.w
        w.members[who] = True
        w.check(response.next_seq == w.seen.get(who, 0) + 1,
                f"{who} joined with next_seq {response.next_seq}; its highest accepted seq "
                f"is {w.seen.get(who, 0)}")
        w.rebase()
        w.check_views(who, response.fragments)

    @initialize()
    def everyone_joined(self) -> None:
        """Each example starts with every learner a member (the last may have left
        them all), so that most pushes and pulls have a learner to come from."""
        for who in POOL:
            if not self.w.members.get(who, False):
                self.rejoin(who)

    def rejoin(self, who: str) -> None:
        w = self.w
        request = pb.JoinRequest(learner_id=who, layout=LAYOUT)
        outcome = w.call("Join", request, lambda: w.sync.Join(
            request, metadata=bearer(TOKENS[who]), timeout=RPC_TIMEOUT))
        w.judge(outcome, True)
        self.joined(who, outcome.response)

    @rule(data=st.data(), who=learner_ids, how=credentials)
    def heartbeat(self, data: st.DataObject, who: str, how: str) -> None:
        self.step()
        w = self.w
        request = pb.HeartbeatRequest(learner_id=who, local_step=data.draw(u64),
                                      backlog=data.draw(u32))
        md = metadata(data, who, how)
        outcome = w.call("Heartbeat", request, lambda: w.sync.Heartbeat(
            request, metadata=md, timeout=RPC_TIMEOUT))
        if w.judge(outcome, authenticates(who, how) and w.members.get(who, False)):
            w.rebase()
            w.check_views(who, outcome.response.fragments)

    @rule(data=st.data(), who=learner_ids, how=credentials, reason=text,
          back=st.integers(0, 7))
    def leave(self, data: st.DataObject, who: str, how: str, reason: str, back: int) -> None:
        """A leave; most learners that left join again at once (else few would be
        left to push)."""
        self.step()
        w = self.w
        request = pb.LeaveRequest(learner_id=who, reason=reason)
        md = metadata(data, who, how)
        outcome = w.call("Leave", request, lambda: w.sync.Leave(request, metadata=md,
                                                                timeout=RPC_TIMEOUT))
        if w.judge(outcome, authenticates(who, how) and w.members.get(who, False)):
            w.members[who] = False
            w.rebase()
            if back:
                self.rejoin(who)

    @rule(who=st.sampled_from(POOL), pairs=st.integers(1, 3))
    def join_races_leave(self, who: str, pairs: int) -> None:
        """Joins and leaves of one learner in flight together; a heartbeat then tells
        which came last."""
        self.step()
        w = self.w
        md = bearer(TOKENS[who])
        joining = pb.JoinRequest(learner_id=who, layout=LAYOUT)
        leaving = pb.LeaveRequest(learner_id=who, reason="race")
        futures = []
        for _ in range(pairs):
            w.calls["Join"] += 1
            w.calls["Leave"] += 1
            futures.append(("Join", joining, w.sync.Join.future(joining, metadata=md,
                                                                timeout=RPC_TIMEOUT)))
            futures.append(("Leave", leaving, w.sync.Leave.future(leaving, metadata=md,
                                                                  timeout=RPC_TIMEOUT)))
        refusals = 0
        for rpc, request, future in futures:
            try:
                outcome = w.noted(Outcome(rpc, describe(request), OK, response=future.result()))
            except grpc.RpcError as error:
                failed: Any = error
                outcome = w.noted(Outcome(rpc, describe(request), failed.code(),
                                          failed.details() or ""))
            if rpc == "Join":
                w.check(outcome.code == OK, f"a valid join was refused: {outcome}")
                w.check(outcome.response.next_seq == w.seen.get(who, 0) + 1,
                        f"{who} joined with next_seq {outcome.response.next_seq}")
            elif outcome.code != OK:
                w.check(outcome.reason == Reason.UNKNOWN_LEARNER.value,
                        f"a leave was refused for another reason than not being a member: "
                        f"{outcome}")
                refusals += 1
        probe = pb.HeartbeatRequest(learner_id=who)
        outcome = w.call("Heartbeat", probe, lambda: w.sync.Heartbeat(probe, metadata=md,
                                                                     timeout=RPC_TIMEOUT))
        w.members[who] = outcome.code == OK
        refusals += outcome.code != OK
        now = w.observe()
        w.check(sum(now.rejections.values()) == sum(w.last.rejections.values()) + refusals,
                "joins racing leaves counted other rejections than the refused leaves")
        w.last = now

    # -- pushes ---------------------------------------------------------------------------

    def valid_push(self, data: st.DataObject) -> tuple[list[pb.PushMessage], Metadata, bool]:
        """A push the model knows the daemon must take (third: whether it must), of a
        member's fresh contribution or a fragment's initial value.

        What is drawn does not depend on the daemon's state, only what it is made into:
        Hypothesis requires the same draws to follow from the same choices, and the
        daemon outlives the examples."""
        w = self.w
        who, p, seed = data.draw(st.tuples(st.integers(0, 15), st.integers(0, len(NUMELS) - 1),
                                           st.integers(0, 2**32 - 1)))
        codec, back = data.draw(st.sampled_from(CODECS)), data.draw(st.integers(0, MAX_STALENESS))
        counts = data.draw(st.tuples(st.integers(1, 2**20), st.integers(1, 64), u64))
        cuts = data.draw(st.lists(st.integers(1, max(NUMELS[p] - 1, 1)), max_size=4))
        members = sorted(m for m, live in w.members.items() if live)
        # Learners whose seqs a mutated push took to the very top have no next one.
        fresh = [m for m in members if w.seen.get(m, 0) < LAST_SEQ - 1] or members
        learner = fresh[who % len(fresh)] if fresh else POOL[0]
        version = w.last.versions[p]
        rng = np.random.default_rng(seed)
        seq = min(w.seen.get(learner, 0) + 1, LAST_SEQ)
        if version < 0:
            values = rng.standard_normal(NUMELS[p]).astype(np.float32)
            head = pb.PushHeader(learner_id=learner, fragment=p, layout_hash=HASH, seq=seq,
                                 codec=pb.CODEC_FP32, numel=NUMELS[p], init=True)
            codec = "fp32"
        else:
            values = (rng.standard_normal(NUMELS[p]) * 0.01).astype(np.float32)
            head = pb.PushHeader(
                learner_id=learner, fragment=p, layout_hash=HASH, seq=seq,
                base_version=version - min(back, version), c_tokens=counts[0],
                c_steps=counts[1], local_step=counts[2], codec=codec_named(codec).wire,
                numel=NUMELS[p])
        messages = [pb.PushMessage(header=head), *chunked(values, codec, cuts)]
        return messages, bearer(TOKENS[learner]), bool(members) and seq < LAST_SEQ

    def push(self, messages: list[pb.PushMessage], md: Metadata, expect: bool | None) -> None:
        w = self.w
        outcome = w.call("PushFragment", messages, lambda: w.sync.PushFragment(
            iter(messages), metadata=md, timeout=RPC_TIMEOUT))
        if w.judge(outcome, expect):
            w.check(messages[0].WhichOneof("kind") == "header",
                    f"a push without a header was taken: {outcome}")
            w.accepted_push(messages, md, outcome.response)

    @rule(data=st.data())
    def push_valid(self, data: st.DataObject) -> None:
        self.step()
        messages, md, must = self.valid_push(data)
        self.push(messages, md, True if must else None)

    @rule(data=st.data(), how=credentials)
    def push_mutated(self, data: st.DataObject, how: str) -> None:
        self.step()
        messages, md, _ = self.valid_push(data)
        if how != "own":
            md = metadata(data, messages[0].header.learner_id, how)
        for _ in range(data.draw(st.integers(1, 3))):
            messages = self.mutated(data, messages)
        self.push(messages, md, None)

    def mutated(self, data: st.DataObject, messages: list[pb.PushMessage]
                ) -> list[pb.PushMessage]:
        """One mutation of a push stream. None leaves it ending early with every chunk
        well-formed (that costs the daemon's cut-notice wait; `push_cut_short` sends
        those). Byte positions are drawn from a fixed range: how many bytes a chunk
        holds depends on the daemon's state (an initial value goes as fp32)."""
        messages = [copy(m) for m in messages]
        chunks = [i for i, m in enumerate(messages) if m.WhichOneof("kind") == "chunk"]
        headers = [i for i, m in enumerate(messages) if m.WhichOneof("kind") == "header"]
        how = data.draw(st.sampled_from((
            "flip", "flip", "flip", "cut data", "pad data", "drop chunk", "duplicate chunk",
            "swap chunks", "chunk offset", "chunk count", "chunk scale", "header", "header",
            "header", "header", "seq edge", "second header", "no header", "oversize",
            "empty chunk")))
        if how in ("flip", "cut data", "pad data", "chunk offset", "chunk count",
                   "chunk scale", "oversize") and chunks:
            chunk = messages[data.draw(st.sampled_from(chunks))].chunk
            if how == "flip" and chunk.data:
                raw = bytearray(chunk.data)
                at, mask = data.draw(st.tuples(st.integers(0, 2**20), st.integers(1, 255)))
                raw[at % len(raw)] ^= mask
                chunk.data = bytes(raw)
            elif how == "cut data":
                chunk.data = chunk.data[:data.draw(st.integers(0, 2**20)) % max(len(chunk.data), 1)]
            elif how == "pad data":
                chunk.data += data.draw(st.binary(min_size=1, max_size=9))
            elif how == "chunk offset":
                chunk.offset = data.draw(u64)
            elif how == "chunk count":
                chunk.count = data.draw(u64)
            elif how == "chunk scale":
                chunk.scale = data.draw(floats32)
            elif how == "oversize":
                chunk.data = bytes(MAX_CHUNK_BYTES + 1)
        elif how == "drop chunk" and len(chunks) > 1:
            del messages[data.draw(st.sampled_from(chunks[:-1]))]
        elif how == "duplicate chunk" and chunks:
            i = data.draw(st.sampled_from(chunks))
            messages.insert(i + 1, copy(messages[i]))
        elif how == "swap chunks" and len(chunks) > 1:
            i, j = data.draw(st.lists(st.sampled_from(chunks), min_size=2, max_size=2,
                                      unique=True))
            messages[i], messages[j] = messages[j], messages[i]
        elif how == "header" and headers:
            self.mutate_header(data, messages[headers[0]].header)
        elif how == "seq edge" and headers:
            messages[headers[0]].header.seq = data.draw(st.sampled_from(U64_EDGES))
        elif how == "second header" and headers:
            at = data.draw(st.integers(1, len(messages)))
            messages.insert(at, copy(messages[headers[0]]))
        elif how == "no header" and headers and chunks:
            del messages[headers[0]]
        elif how == "empty chunk" and chunks:
            i = data.draw(st.sampled_from(chunks))
            offset = messages[i].chunk.offset
            messages.insert(i, pb.PushMessage(chunk=pb.Chunk(offset=offset, count=0,
                                                             scale=1.0)))
        for head in (m.header for m in messages if m.WhichOneof("kind") == "header"):
            # The pool's first learner keeps seqs to spare: a mutated push taken at the
            # top seq leaves its learner no next one, and once every learner was there
            # no push could be taken again (a run drew that: 40 of 2,511 taken).
            if head.learner_id == POOL[0] and head.seq == MAX_SEQ:
                head.seq = LAST_SEQ
        return messages

    @staticmethod
    def mutate_header(data: st.DataObject, head: pb.PushHeader) -> None:
        field = data.draw(st.sampled_from((
            "learner_id", "fragment", "layout_hash", "seq", "base_version", "c_tokens",
            "c_steps", "local_step", "codec", "numel", "init")))
        draw: dict[str, st.SearchStrategy[Any]] = {
            "learner_id": learner_ids, "fragment": fragments,
            "layout_hash": st.one_of(text, st.just(HASH)), "seq": u64, "base_version": i64,
            "c_tokens": u64, "c_steps": u64, "local_step": u64, "codec": codec_values,
            "numel": st.one_of(st.sampled_from(NUMELS), u64), "init": st.booleans()}
        setattr(head, field, data.draw(draw[field]))

    @rule(data=st.data(), how=credentials)
    def push_random(self, data: st.DataObject, how: str) -> None:
        """A push built from nothing: each header field drawn whole, random chunks."""
        self.step()
        head = pb.PushHeader(
            learner_id=data.draw(learner_ids), fragment=data.draw(fragments),
            layout_hash=data.draw(st.one_of(st.just(HASH), text)), seq=data.draw(u64),
            base_version=data.draw(i64), c_tokens=data.draw(u64), c_steps=data.draw(u64),
            local_step=data.draw(u64), codec=data.draw(codec_values),
            numel=data.draw(st.one_of(st.sampled_from(NUMELS), u64)), init=data.draw(st.booleans()))
        chunks = data.draw(st.lists(st.builds(
            pb.Chunk, offset=st.one_of(st.integers(0, 1000), u64), count=st.one_of(
                st.integers(0, 1000), u64), scale=floats32, data=st.binary(max_size=64)),
            min_size=1, max_size=4))
        messages = [pb.PushMessage(header=head), *(pb.PushMessage(chunk=c) for c in chunks)]
        self.push(messages, metadata(data, head.learner_id, how), None)

    @initialize(one_in=st.integers(0, CUT_ONE_IN - 1))
    def plan(self, one_in: int) -> None:
        """Whether this example sends a batch of pushes cut short (they are slow)."""
        self.cut_pending = one_in == 0

    @precondition(lambda self: self.cut_pending and self.local_steps >= CUT_AFTER)
    @rule(data=st.data())
    def push_cut_short(self, data: st.DataObject) -> None:
        """Valid pushes that end early (no chunk, some, none at all), in flight together:
        the daemon waits out each before it refuses it."""
        self.step()
        w = self.w
        self.cut_pending = False
        w.cut_batches += 1
        streams = []
        for _ in range(CUT_BATCH):
            messages, md, _ = self.valid_push(data)
            messages = messages[:data.draw(st.integers(0, len(messages) - 1))]
            streams.append((messages, w.push_future(messages, md)))
        w.refused([w.settled(future, messages) for messages, future in streams])

    @rule(which=st.integers(0, 63))
    def replay(self, which: int) -> None:
        """An accepted push (there is one from the start), again: a replayed
        contribution or initial value."""
        self.step()
        messages, md = self.w.accepted[which % len(self.w.accepted)]
        self.push(messages, md, False)

    # -- pulls, snapshots and status ---------------------------------------------------

    @rule(data=st.data(), who=learner_ids, how=credentials, fragment=fragments,
          wait_ms=st.sampled_from((0, 0, 1, 5, 2**32 - 1)), have=st.integers(0, 9))
    def pull(self, data: st.DataObject, who: str, how: str, fragment: int, wait_ms: int,
             have: int) -> None:
        self.step()
        w = self.w
        current = w.last.versions[fragment] if fragment < len(NUMELS) else -1
        # Mostly about the current version, else any.
        have = (-1, current - 1, current, current + 1)[have % 4] if have < 8 else data.draw(i64)
        newer = current >= 0 and have < current
        if not newer:
            wait_ms = min(wait_ms, 5)  # no newer version comes: do not hold the fuzzer
        request = pb.PullRequest(learner_id=who, fragment=fragment, have_version=have,
                                 wait_ms=wait_ms)
        md = metadata(data, who, how)
        outcome = w.call("PullFragment", request, lambda: list(w.sync.PullFragment(
            request, metadata=md, timeout=RPC_TIMEOUT)))
        valid = (authenticates(who, how) and w.members.get(who, False)
                 and fragment < len(NUMELS) and have <= current)
        if not w.judge(outcome, valid):
            return
        parts = assembled(outcome.response)
        w.check(len(parts) == 1, f"a pull answered {len(parts)} headers: {outcome}")
        header, values = parts[0]
        if newer:
            w.check_published(fragment, header, values, "a pull")
        else:
            w.check(header.not_modified and header.version == have and header.numel == 0,
                    f"a pull for a version newer than {have} answered {header}")
        w.rebase()

    @rule(data=st.data(), who=learner_ids, how=credentials)
    def snapshot(self, data: st.DataObject, who: str, how: str) -> None:
        self.step()
        w = self.w
        request = pb.SnapshotRequest(learner_id=who)
        md = metadata(data, who, how)
        outcome = w.call("FetchSnapshot", request, lambda: list(w.sync.FetchSnapshot(
            request, metadata=md, timeout=RPC_TIMEOUT)))
        if not w.judge(outcome, authenticates(who, how) and w.members.get(who, False)):
            return
        parts = assembled(outcome.response)
        w.check([h.fragment for h, _ in parts] == list(range(len(NUMELS))),
                f"a snapshot answered fragments {[h.fragment for h, _ in parts]}")
        for p, (header, values) in enumerate(parts):
            if w.last.versions[p] < 0:
                w.check(header.version == -1 and values.size == 0,
                        f"a snapshot of uninitialized fragment {p} answered {header}")
            else:
                w.check_published(p, header, values, "a snapshot")
        w.rebase()

    @rule(data=st.data(), how=st.sampled_from(("admin", "admin", "none", "wrong",
                                                "learner", "junk")))
    def status(self, data: st.DataObject, how: str) -> None:
        self.step()
        w = self.w
        md: Metadata = {"admin": bearer(ADMIN_TOKEN), "none": (),
                        "learner": bearer(TOKENS[POOL[0]])}.get(how, ())
        if how == "wrong":
            md = bearer(data.draw(metadata_values))
        elif how == "junk":
            md = (*data.draw(st.lists(st.tuples(metadata_keys, metadata_values), max_size=3)),
                  *bearer(ADMIN_TOKEN))
        request = pb.StatusRequest()
        outcome = w.call("Status", request, lambda: w.admin.Status(
            request, metadata=md, timeout=RPC_TIMEOUT))
        if w.judge(outcome, how in ("admin", "junk")):
            w.check(observed(outcome.response).state == w.last.state,
                    "Status changed while nothing was called")

    @rule(data=st.data(), how=st.sampled_from(("none", "wrong", "learner", "junk")),
          timeout=st.one_of(st.floats(), st.just(0.0)))
    def drain_refused(self, data: st.DataObject, how: str, timeout: float) -> None:
        """Drain without the admin credentials (with them the daemon would drain and
        exit: `test_drain` covers that)."""
        self.step()
        w = self.w
        md: Metadata = {"none": (), "learner": bearer(TOKENS[POOL[0]])}.get(how, ())
        if how == "wrong":
            md = bearer(data.draw(metadata_values))
        elif how == "junk":
            md = tuple(data.draw(st.lists(st.tuples(metadata_keys, metadata_values),
                                          max_size=3)))
        request = pb.DrainRequest(timeout_s=timeout)
        outcome = w.call("Drain", request, lambda: w.admin.Drain(
            request, metadata=md, timeout=RPC_TIMEOUT))
        w.judge(outcome, False)

    @rule(service=st.one_of(st.sampled_from(HEALTH_SERVICES), text))
    def health(self, service: str) -> None:
        """The standard health service: the daemon serves, and knows only its names."""
        self.step()
        w = self.w
        request = health_pb2.HealthCheckRequest(service=service)
        outcome = w.call("Health.Check", request, lambda: w.health.Check(
            request, timeout=RPC_TIMEOUT))
        if service in HEALTH_SERVICES:
            w.check(outcome.code == OK and outcome.response.status == SERVING,
                    f"the daemon is not serving: {outcome}")
        else:
            w.check(outcome.code == grpc.StatusCode.NOT_FOUND, f"an unknown service: {outcome}")
            w.refused([outcome], counted=False)

    @rule(data=st.data())
    def replicate(self, data: st.DataObject) -> None:
        """An embedded daemon follows no leader: whatever is streamed, UNIMPLEMENTED."""
        self.step()
        w = self.w
        messages = data.draw(REPLICA_STREAMS)
        outcome = w.call("Replicate", messages, lambda: w.replication.Replicate(
            iter(messages), metadata=bearer(data.draw(metadata_values)), timeout=RPC_TIMEOUT))
        w.check(outcome.code == grpc.StatusCode.UNIMPLEMENTED,
                f"an embedded daemon took replication: {outcome}")
        w.refused([outcome], counted=False)


def copy(message: pb.PushMessage) -> pb.PushMessage:
    duplicate = pb.PushMessage()
    duplicate.CopyFrom(message)
    return duplicate


# Manifests that are no JSON list of contributions, or that no JSON reader should recurse
# into (the daemon's limit on a message is 8 MiB).
MANIFESTS = ("{", "{}", "null", "[1, 2]", '[{"learner": 5}]', "1e999", "[" * 100_000,
             '{"a":' * 100_000)


@st.composite
def replica_streams(draw: st.DrawFn, versions: Sequence[int], numels: Sequence[int] = NUMELS,
                    layout_hash: str = HASH, epochs: st.SearchStrategy[int] = u64
                    ) -> list[pb.ReplicaMessage]:
    """A Replicate stream: a plausible header of the next version, some of it redrawn,
    and chunks that may or may not fit it."""
    fragment = draw(st.integers(0, len(numels) - 1))
    numel = numels[fragment]
    head = pb.ReplicaHeader(
        epoch=draw(epochs), leader_id=draw(text), run_id=draw(text), layout_hash=layout_hash,
        numels=numels, fragment=fragment, version=versions[fragment] + 1, numel=numel,
        manifest_json=draw(st.one_of(st.just("[]"), st.sampled_from(MANIFESTS), text)),
        commit_epoch=draw(epochs), commit_id=draw(u64))
    for field in draw(st.sets(st.sampled_from((
            "numels", "fragment", "version", "numel", "size", "watermarks", "layout_hash")),
            max_size=3)):
        if field == "numels":
            head.ClearField("numels")
            head.numels.extend(draw(st.lists(u64, max_size=4)))
        elif field == "fragment":
            head.fragment = draw(u32)
        elif field == "version":
            head.version = draw(i64)
        elif field == "numel":
            head.numel = draw(u64)
        elif field == "size" and head.fragment < len(head.numels):
            # A fragment of another size, said alike in both places.
            head.numel = head.numels[head.fragment] = draw(u64)
        elif field == "watermarks":
            head.watermarks.update(draw(st.dictionaries(text, u64, max_size=3)))
        elif field == "layout_hash":
            head.layout_hash = draw(text)
    messages = [pb.ReplicaMessage(header=head)]
    if draw(st.booleans()):
        total = 2 * numel
        cuts = sorted(draw(st.sets(st.integers(1, total), max_size=3)) | {total})
        start = 0
        for end in cuts:
            messages.append(pb.ReplicaMessage(chunk=pb.Chunk(
                offset=start, count=end - start, data=bytes(4 * (end - start)))))
            start = end
        if draw(st.booleans()) and len(messages) > 1:
            del messages[draw(st.integers(0, len(messages) - 1))]
    else:
        messages += [pb.ReplicaMessage(chunk=c) for c in draw(st.lists(st.builds(
            pb.Chunk, offset=st.one_of(st.integers(0, 100), u64),
            count=st.one_of(st.integers(0, 100), u64), data=st.binary(max_size=64)),
            max_size=3))]
    return messages


# Of a version that the embedded daemon could hold. (Strategies the state machine draws
# from are the same whatever the daemon's state: Hypothesis tells its draws apart by
# their strategies, and a replay must find the same ones.)
REPLICA_STREAMS = replica_streams((0,) * len(NUMELS))

# No shrinking, no example database: the daemon outlives the examples, so a failing one
# would not fail alike when replayed (`World.fail` keeps the first failure instead).
FUZZ_SETTINGS = settings(
    max_examples=ROUND_EXAMPLES, stateful_step_count=STEPS, deadline=None,
    database=None, phases=[Phase.generate], print_blob=False,
    suppress_health_check=list(HealthCheck))


def started_world(start_daemon: Callable[..., Daemon]) -> World:
    """A daemon with every learner joined and fragment 0 initialized."""
    daemon = start_daemon(*ARGS)
    daemon.admin_token = ADMIN_TOKEN
    world = World(daemon)
    for learner in (*POOL, OBSERVER):
        response = world.sync.Join(pb.JoinRequest(learner_id=learner, layout=LAYOUT),
                                   metadata=bearer(TOKENS[learner]), timeout=RPC_TIMEOUT)
        assert response.next_seq == 1
        world.members[learner] = learner != OBSERVER
    values = np.random.default_rng(0).standard_normal(NUMELS[0]).astype(np.float32)
    messages = [pb.PushMessage(header=pb.PushHeader(
        learner_id=POOL[0], fragment=0, layout_hash=HASH, seq=1, codec=pb.CODEC_FP32,
        numel=NUMELS[0], init=True)), *chunked(values, "fp32", [])]
    world.rebase()
    md = bearer(TOKENS[POOL[0]])
    world.accepted_push(messages, md, world.sync.PushFragment(iter(messages), metadata=md,
                                                              timeout=RPC_TIMEOUT))
    return world


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_daemon_survives_ten_thousand_fuzzed_calls(
        start_daemon: Callable[..., Daemon]) -> None:
    world = started_world(start_daemon)
    DaemonFuzzer.world = world
    started = time.monotonic()
    rounds = 0
    try:
        while sum(world.calls.values()) < TARGET_CALLS:
            assert rounds < MAX_ROUNDS, f"{MAX_ROUNDS} rounds made {dict(world.calls)}"
            machine = seed(rounds)(type(f"DaemonFuzzerRound{rounds}", (DaemonFuzzer,), {}))
            run_state_machine_as_test(machine, settings=FUZZ_SETTINGS)
            rounds += 1
        took = time.monotonic() - started
        # Still serving, and still committing: the observer contributes once.
        world.rebase()
        version, seq = world.last.versions[0], world.seen.get(OBSERVER, 0) + 1
        values = np.full(NUMELS[0], 0.01, np.float32)
        messages = [pb.PushMessage(header=pb.PushHeader(
            learner_id=OBSERVER, fragment=0, layout_hash=HASH, seq=seq, base_version=version,
            c_tokens=1, c_steps=1, codec=pb.CODEC_FP32, numel=NUMELS[0])),
            *chunked(values, "fp32", [])]
        md = bearer(TOKENS[OBSERVER])
        world.accepted_push(messages, md, world.sync.PushFragment(
            iter(messages), metadata=md, timeout=RPC_TIMEOUT))
    except Exception:
        if world.failure:
            pytest.fail(world.failure, pytrace=False)
        raise
    finally:
        world.close()
    calls = sum(world.calls.values())
    print(f"{calls} fuzzed calls in {world.steps} steps, {rounds} rounds, {took:.1f} s "
          f"({world.slow_calls} over 0.3 s, "
          f"{world.cut_batches} batches of pushes cut short): "
          f"{dict(world.calls)}")
    print("outcomes:", dict(sorted(world.outcomes.items())))
    assert calls >= TARGET_CALLS, f"only {calls} calls: {dict(world.calls)}"
    assert all(world.calls[rpc] >= 100 for rpc in (
        "Join", "Heartbeat", "PushFragment", "PullFragment", "FetchSnapshot", "Leave",
        "Status", "Drain", "Replicate", "Health.Check")), dict(world.calls)
    assert world.daemon.process is not None and world.daemon.process.poll() is None
    taken = sum(n for (rpc, code), n in world.outcomes.items()
                if rpc == "PushFragment" and code == "OK")
    assert taken >= 100, f"only {taken} pushes were taken"


# -- replication --------------------------------------------------------------------------

REPLICA_TOKEN = "replicas-only"
REPLICA_CALLS = 1500


def digest(root: Path) -> str:
    """Names and bytes of every file under `root`."""
    sha = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        sha.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()


@pytest.fixture
def leader(tmp_path: Path, etcd: EtcdCluster) -> Iterator[World]:
    """The leader of a highly available run (one replica, a real etcd) with the
    replicas' token, learner a joined and fragment 0 at version 1; its state directory
    is part of the state."""
    state_dir = tmp_path / "replica"
    daemon = Daemon(state_dir=state_dir, args=[
        "--etcd", ",".join(etcd.endpoints), "--replica-id", "r0",
        "--set", f"ha.token={REPLICA_TOKEN}", "--set", "ha.lease_ttl_s=10",
        "--set", "policy.grace_max_s=0", "--set", "fsync=false"])
    daemon.start()
    try:
        wait_until(lambda: daemon.status().role == "leader", timeout=30,
                   message="the replica to lead")
        join(daemon)
        init(daemon)
        contribute_and_commit(daemon, seq=2)
        world = World(daemon, digest=lambda: digest(state_dir))
        assert world.last.versions == (1, -1)
        yield world
        world.close()
        assert daemon.status().role == "leader"
        contribute_and_commit(daemon, seq=3)
    finally:
        daemon.stop()


def next_version(world: World) -> list[pb.ReplicaMessage]:
    """Version 2 of fragment 0 as the leader's own epoch would stream it (and so
    refused, as from a stale epoch)."""
    status = world.last.status
    run = RunRecord(status.run_id, status.layout_hash, (NUMEL, NUMEL))
    record = FragmentRecord(0, 2, np.ones(NUMEL, np.float32), np.zeros(NUMEL, np.float32),
                            {"a": 2}, [], 1)
    return list(replica_messages(status.epoch, "r0", run, record))


def replicate(world: World, messages: list[pb.ReplicaMessage], md: Metadata) -> Outcome:
    return world.call("Replicate", messages, lambda: world.replication.Replicate(
        iter(messages), metadata=md, timeout=RPC_TIMEOUT))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replication_fuzz(leader: World) -> None:
    """`Replicate` with the replicas' token or without, streams generated and mutated
    from a valid one of the next version: huge, negative and inconsistent sizes, chunks
    that do not fit, manifests that are not JSON lists or nest past any recursion
    limit. Every stream comes from an epoch no newer than the leader's, so each must be
    refused, under its reason and counted, leaving Status and every byte of the state
    directory as they were. (A newer epoch's version is taken by design: that is a new
    leader speaking, which `test_ha` covers.)"""
    world = leader
    epoch, versions = world.last.status.epoch, world.last.versions
    assert epoch >= 1

    streams = replica_streams(versions, (NUMEL, NUMEL), world.last.status.layout_hash,
                              st.integers(0, epoch))

    @settings(max_examples=REPLICA_CALLS, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        messages = data.draw(streams)
        md = data.draw(st.sampled_from((bearer(REPLICA_TOKEN),) * 6 + ((), bearer("no"))))
        world.refused([replicate(world, messages, md)])

    try:
        fuzz()
    except Exception:
        if world.failure:
            pytest.fail(world.failure, pytrace=False)
        raise
    print("outcomes:", dict(sorted(world.outcomes.items())))
    assert world.calls["Replicate"] >= REPLICA_CALLS


def test_a_replicated_fragment_too_large_to_hold_is_refused_before_allocating(
        leader: World) -> None:
    """Found by the fuzzer: a Replicate header saying a fragment has 2^32 elements
    (in `numel` and in `numels` alike) had the replica allocate 32 GiB for it before a
    byte arrived; it ended in UNKNOWN (out of memory). The run's size is now held to
    what a first Join may ask, before anything is allocated."""
    messages = next_version(leader)
    messages[0].header.numel = messages[0].header.numels[0] = 2**40
    outcome = replicate(leader, messages, bearer(REPLICA_TOKEN))
    assert outcome.code == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome
    assert f"{2**40 + NUMEL:,} parameters" in outcome.details, outcome
    leader.refused([outcome])


def test_a_replicated_manifest_nested_past_the_recursion_limit_is_malformed(
        leader: World) -> None:
    """Found by the fuzzer: a manifest of 100,000 nested lists ended in UNKNOWN (the
    JSON reader's RecursionError is no ValueError)."""
    messages = next_version(leader)
    messages[0].header.manifest_json = "[" * 100_000
    outcome = replicate(leader, messages, bearer(REPLICA_TOKEN))
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert "manifest is not JSON" in outcome.details, outcome
    leader.refused([outcome])

