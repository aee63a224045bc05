"""Bad input against a real daemon (DESIGN.md §8): every refusal is a gRPC status with
a message that names the problem, is counted under its reason, and changes no state.

Each test starts its own coordinator on an ephemeral port, talks to it over real gRPC
with synchronous clients, and compares a snapshot of everything a rejection must not
touch (versions, open rounds, merged contributions, commits, per-learner counts and the
published parameters themselves) before and after the bad request. Variants of one bad
input share a test and its daemon (a daemon start costs about a second), each checked on
its own and named in the failure. Where it makes sense a valid push afterwards shows the
daemon is not wedged, reusing the rejected push's sequence number, since a refused
contribution must not burn its id either.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest

from coordinator.durability import FragmentRecord, RunRecord
from coordinator.errors import Reason
from coordinator.replication import replica_messages
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc
from protos.codec import MAX_CHUNK_BYTES, codec_named, decode_chunk_into, iter_chunks
from protos.metadata import REASON
from protos.metadata import reason as reason_code
from tests.daemon import Daemon, wait_until

# -- helpers -------------------------------------------------------------------

Metadata = Sequence[tuple[str, str]]
StartDaemon = Callable[..., Daemon]

NUMEL = 1000
HASH = "layout-v1"
LAYOUT = pb.Layout(hash=HASH, fragments=[pb.FragmentSpec(fragment=0, numel=NUMEL),
                                         pb.FragmentSpec(fragment=1, numel=NUMEL)])
RPC_TIMEOUT = 10.0
FP32 = codec_named("fp32")
# An outer gradient well inside every norm bound used here (norm about 0.3).
GRADIENT = (np.random.default_rng(1).standard_normal(NUMEL) * 0.01).astype(np.float32)
INITIAL = np.random.default_rng(0).standard_normal(NUMEL).astype(np.float32)
# Rounds close as soon as every live learner contributed; the grace window only
# matters when a joined learner stays silent, and then it should be short.
FAST = ("--set", "policy.grace_max_s=0.2")

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


def stub(daemon: Daemon) -> tuple[grpc.Channel, pb_grpc.SynchronizerStub]:
    channel = grpc.insecure_channel(daemon.address)
    return channel, pb_grpc.SynchronizerStub(channel)


def join(daemon: Daemon, learner_id: str = "a", layout: pb.Layout = LAYOUT,
         metadata: Metadata = ()) -> pb.JoinResponse:
    channel, synchronizer = stub(daemon)
    with channel:
        response: pb.JoinResponse = synchronizer.Join(
            pb.JoinRequest(learner_id=learner_id, layout=layout, host="test"),
            metadata=metadata, timeout=RPC_TIMEOUT)
        return response


def heartbeat(daemon: Daemon, learner_id: str = "a",
              metadata: Metadata = ()) -> pb.HeartbeatResponse:
    channel, synchronizer = stub(daemon)
    with channel:
        response: pb.HeartbeatResponse = synchronizer.Heartbeat(
            pb.HeartbeatRequest(learner_id=learner_id, local_step=1),
            metadata=metadata, timeout=RPC_TIMEOUT)
        return response


def leave(daemon: Daemon, learner_id: str = "a", metadata: Metadata = ()) -> None:
    channel, synchronizer = stub(daemon)
    with channel:
        synchronizer.Leave(pb.LeaveRequest(learner_id=learner_id, reason="test"),
                           metadata=metadata, timeout=RPC_TIMEOUT)


def header(**fields: Any) -> pb.PushHeader:
    """A valid contribution header for learner a, fragment 0, against version 0."""
    values: dict[str, Any] = {
        "learner_id": "a", "fragment": 0, "layout_hash": HASH, "seq": 2, "base_version": 0,
        "c_tokens": 1000, "c_steps": 10, "local_step": 1, "codec": pb.CODEC_FP32,
        "numel": NUMEL}
    values.update(fields)
    return pb.PushHeader(**values)


def send(daemon: Daemon, messages: Iterable[pb.PushMessage],
         metadata: Metadata = ()) -> pb.PushResponse:
    """One PushFragment stream of exactly `messages`."""
    channel, synchronizer = stub(daemon)
    with channel:
        response: pb.PushResponse = synchronizer.PushFragment(
            iter(list(messages)), metadata=metadata, timeout=RPC_TIMEOUT)
        return response


def silent_until(cancelled: threading.Event) -> Iterator[pb.PushMessage]:
    """A push stream that sends nothing, ending when its call has been cancelled."""
    cancelled.wait(RPC_TIMEOUT)
    yield from ()


def push(daemon: Daemon, values: np.ndarray | None = None, *,
         chunks: Iterable[pb.Chunk] | None = None, metadata: Metadata = (),
         **fields: Any) -> pb.PushResponse:
    """Push `values` (default: a small outer gradient) with a header from `fields`.

    `codec` may be a codec name (the chunks are encoded with it) or a raw enum value
    (the chunks go as fp32); `chunks` replaces the encoded chunks outright."""
    values = GRADIENT if values is None else values
    codec = fields.pop("codec", "fp32")
    if isinstance(codec, str):
        encoder = codec_named(codec)
        fields["codec"] = encoder.wire
    else:
        encoder = FP32
        fields["codec"] = codec
    if chunks is None:
        chunks = iter_chunks(values, encoder)
    messages = [pb.PushMessage(header=header(**fields))]
    messages += [pb.PushMessage(chunk=chunk) for chunk in chunks]
    return send(daemon, messages, metadata)


def init(daemon: Daemon, fragment: int = 0, learner_id: str = "a", seq: int = 1,
         values: np.ndarray = INITIAL, metadata: Metadata = ()) -> pb.PushResponse:
    return push(daemon, values, metadata=metadata, learner_id=learner_id,
                fragment=fragment, seq=seq, init=True, c_tokens=0, c_steps=0)


def pull(daemon: Daemon, learner_id: str = "a", fragment: int = 0, have_version: int = -1,
         wait_ms: int = 0, metadata: Metadata = (),
         codec: pb.Codec = pb.CODEC_FP32) -> tuple[pb.PullHeader, np.ndarray]:
    channel, synchronizer = stub(daemon)
    with channel:
        messages = list(synchronizer.PullFragment(
            pb.PullRequest(learner_id=learner_id, fragment=fragment,
                           have_version=have_version, wait_ms=wait_ms, codec=codec),
            metadata=metadata, timeout=RPC_TIMEOUT))
    head = messages[0].header
    values = np.empty(head.numel, np.float32)
    for message in messages[1:]:
        decode_chunk_into(message.chunk, FP32, values)
    return head, values


def snapshot(daemon: Daemon, learner_id: str = "a", metadata: Metadata = ()) -> None:
    channel, synchronizer = stub(daemon)
    with channel:
        list(synchronizer.FetchSnapshot(pb.SnapshotRequest(learner_id=learner_id),
                                        metadata=metadata, timeout=RPC_TIMEOUT))


def fp32_chunk(values: np.ndarray, offset: int, count: int) -> pb.Chunk:
    data = values[offset:offset + count].astype("<f4").tobytes()
    return pb.Chunk(offset=offset, count=count, scale=1.0, data=data)


def version(daemon: Daemon, fragment: int = 0) -> int:
    return int(daemon.status().fragments[fragment].version)


def state(daemon: Daemon, learner_id: str | None = "a",
          metadata: Metadata = ()) -> tuple[Any, ...]:
    """Everything a rejection must leave alone, comparable with `==`.

    Rejection and byte counters are left out (they legitimately move), and so are
    ages and liveness (they move with the clock). With a `learner_id`, the published
    parameters of every initialized fragment are pulled and hashed too."""
    status = daemon.status()
    fragments = tuple((f.fragment, f.version, f.numel, tuple(f.round_learners), f.commits,
                       f.merged_contributions) for f in status.fragments)
    learners = tuple((lr.learner_id, lr.contributions, lr.local_step, lr.backlog,
                      lr.step_time_s, lr.host) for lr in status.learners)
    params = ()
    if learner_id is not None:
        params = tuple(
            hashlib.sha256(pull(daemon, learner_id, f.fragment, metadata=metadata)[1]
                           .tobytes()).hexdigest()
            for f in status.fragments if f.version >= 0)
    return (status.run_id, status.layout_hash, status.min_quorum, fragments, learners,
            params)


def rejections(daemon: Daemon) -> Counter[str]:
    return Counter(dict(daemon.status().rejections))


def expect_rejected(daemon: Daemon, action: Callable[[], object], code: grpc.StatusCode,
                    reason: Reason, *needles: str, learner_id: str | None = "a",
                    metadata: Metadata = (), case: str = "") -> str:
    """Run `action`; it must fail with `code`, the reason code in the `ftsync-reason`
    trailing metadata, a message holding every needle, one more rejection counted
    under `reason` (and nothing else), and no change of state.

    `case` labels the failure when one test runs several variants of a bad input."""
    where = f"[{case}] " if case else ""
    before = state(daemon, learner_id, metadata)
    counts = rejections(daemon)
    with pytest.raises(grpc.RpcError) as info:
        action()
    error: Any = info.value
    details = error.details() or ""
    assert error.code() == code, f"{where}got {error.code()}: {details!r}"
    assert reason_code(error) == reason.value, (
        f"{where}trailing metadata {error.trailing_metadata()!r} lacks "
        f"{REASON}: {reason.value}")
    for needle in needles:
        assert needle in details, f"{where}{needle!r} not in the message {details!r}"
    counts[reason.value] += 1
    assert rejections(daemon) == counts, (
        f"{where}rejections should count exactly one more {reason.value}")
    assert state(daemon, learner_id, metadata) == before, f"{where}a rejection changed state"
    return str(details)


def contribute_and_commit(daemon: Daemon, seq: int, learner_id: str = "a", fragment: int = 0,
                          metadata: Metadata = ()) -> None:
    """A valid contribution against the current version, and its round's commit."""
    current = version(daemon, fragment)
    response = push(daemon, metadata=metadata, learner_id=learner_id, fragment=fragment,
                    seq=seq, base_version=current)
    assert response.target_version == current + 1
    wait_until(lambda: version(daemon, fragment) == current + 1, timeout=10,
               message=f"fragment {fragment} to commit version {current + 1}")


def started(start_daemon: StartDaemon, *args: str) -> Daemon:
    """A daemon with learner a joined and fragment 0 initialized (version 0)."""
    daemon = start_daemon(*FAST, *args)
    join(daemon)
    assert init(daemon).target_version == 0
    assert version(daemon) == 0
    return daemon


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def metrics_text(port: int) -> str:
    """The daemon's Prometheus page (`--prometheus-listen`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def push_streams_open(port: int) -> float:
    """The push calls the daemon's handler has taken up and not finished: what a test
    waits for before cancelling a call it means the daemon to see."""
    (line,) = [line for line in metrics_text(port).splitlines()
               if line.startswith("ftsync_push_streams_open")] or ["none 0"]
    return float(line.rsplit(" ", 1)[1])


# -- membership and authentication ---------------------------------------------

UNKNOWN_LEARNER_CALLS: dict[str, Callable[[Daemon], object]] = {
    "push": lambda d: push(d, learner_id="ghost"),
    "pull": lambda d: pull(d, learner_id="ghost"),
    "heartbeat": lambda d: heartbeat(d, learner_id="ghost"),
    "leave": lambda d: leave(d, learner_id="ghost"),
    "snapshot": lambda d: snapshot(d, learner_id="ghost"),
}


def test_unknown_learner_is_not_found(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    for rpc, call in UNKNOWN_LEARNER_CALLS.items():
        expect_rejected(daemon, partial(call, daemon), grpc.StatusCode.NOT_FOUND,
                        Reason.UNKNOWN_LEARNER, "'ghost'", "Join", case=rpc)
    contribute_and_commit(daemon, seq=2)


def test_learner_that_left_cannot_push(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    join(daemon, "b")
    leave(daemon, "b")
    expect_rejected(daemon, partial(push, daemon, learner_id="b", seq=1),
                    grpc.StatusCode.NOT_FOUND, Reason.UNKNOWN_LEARNER, "'b'", "left")
    contribute_and_commit(daemon, seq=2)


TOKENS = ("--set", 'auth.tokens={a="token-a", b="token-b"}')
GOOD_TOKEN = bearer("token-a")
BAD_CREDENTIALS: dict[str, Metadata] = {
    "missing": (),
    "wrong": bearer("not-the-token"),
    "another learner's": bearer("token-b"),
    "no bearer scheme": (("authorization", "token-a"),),
}
AUTHENTICATED_CALLS: dict[str, Callable[[Daemon, Metadata], object]] = {
    "join": lambda d, m: join(d, metadata=m),
    "heartbeat": lambda d, m: heartbeat(d, metadata=m),
    "push": lambda d, m: push(d, metadata=m),
    "pull": lambda d, m: pull(d, metadata=m),
    "snapshot": lambda d, m: snapshot(d, metadata=m),
    "leave": lambda d, m: leave(d, metadata=m),
}


def test_bad_token_is_unauthenticated(start_daemon: StartDaemon) -> None:
    daemon = start_daemon(*FAST, *TOKENS)
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED
    # Before any learner joined: a refused Join must not create the run.
    for credentials, bad in BAD_CREDENTIALS.items():
        expect_rejected(daemon, partial(join, daemon, metadata=bad), unauthenticated,
                        Reason.UNAUTHENTICATED, "token", "'a'", learner_id=None,
                        case=f"first join, {credentials}")
    assert daemon.status().run_id == ""
    join(daemon, metadata=GOOD_TOKEN)
    init(daemon, metadata=GOOD_TOKEN)
    for credentials, bad in BAD_CREDENTIALS.items():
        for rpc, call in AUTHENTICATED_CALLS.items():
            expect_rejected(daemon, partial(call, daemon, bad), unauthenticated,
                            Reason.UNAUTHENTICATED, "token", "'a'", metadata=GOOD_TOKEN,
                            case=f"{rpc}, {credentials}")
        # A stream without a header names no learner: only its token is checked,
        # and another learner's is some learner's.
        if credentials != "another learner's":
            chunk_first = [pb.PushMessage(chunk=fp32_chunk(GRADIENT, 0, NUMEL))]
            for case, messages in (("empty", []), ("chunk first", chunk_first)):
                expect_rejected(daemon, partial(send, daemon, messages, metadata=bad),
                                unauthenticated, Reason.UNAUTHENTICATED, "token", "no header",
                                metadata=GOOD_TOKEN,
                                case=f"header-less push ({case}), {credentials}")
    for token in ("token-a", "token-b"):
        expect_rejected(daemon, partial(send, daemon, [], metadata=bearer(token)),
                        INVALID_ARGUMENT, Reason.MALFORMED, "starts with a header",
                        metadata=GOOD_TOKEN, case=f"header-less push, {token}")
    contribute_and_commit(daemon, seq=2, metadata=GOOD_TOKEN)
    heartbeat(daemon, metadata=GOOD_TOKEN)
    assert pull(daemon, metadata=GOOD_TOKEN)[0].version == 1


def test_a_header_less_push_cut_off_without_a_token_is_no_learners_cut(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    """Cancelled before sending anything, by a caller holding no learner's token:
    refused as unauthenticated, not waited out and counted as a push cut short."""
    log, port = tmp_path / "events.jsonl", free_port()
    daemon = start_daemon(*FAST, *TOKENS, "--event-log", str(log),
                          "--prometheus-listen", str(port))
    before = rejections(daemon)
    cancelled = threading.Event()
    channel, synchronizer = stub(daemon)
    with channel:
        call = synchronizer.PushFragment.future(silent_until(cancelled),
                                                metadata=bearer("nobody's"))
        wait_until(lambda: push_streams_open(port) == 1, timeout=10,
                   message="the daemon's handler taking the call up")
        call.cancel()
    cancelled.set()
    wait_until(lambda: rejections(daemon)["unauthenticated"] == before["unauthenticated"] + 1,
               timeout=10, message="the unauthenticated header-less push refused")
    assert '"push_cut"' not in log.read_text()


def test_learner_without_a_configured_token_is_unauthenticated(
        start_daemon: StartDaemon) -> None:
    daemon = start_daemon(*FAST, *TOKENS)
    join(daemon, metadata=GOOD_TOKEN)
    expect_rejected(daemon, partial(join, daemon, "c", metadata=GOOD_TOKEN),
                    grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED,
                    "'c'", "no token", metadata=GOOD_TOKEN)


# -- fragment ids and layouts -------------------------------------------------------


def test_unknown_fragment_is_invalid_argument(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    for rpc, call in (("push", push), ("pull", pull)):
        expect_rejected(daemon, partial(call, daemon, fragment=7), INVALID_ARGUMENT,
                        Reason.UNKNOWN_FRAGMENT, "fragment 7", "0..1", case=rpc)
    contribute_and_commit(daemon, seq=2)


def _layout(hash_: str, *numels: int) -> pb.Layout:
    return pb.Layout(hash=hash_, fragments=[pb.FragmentSpec(fragment=i, numel=n)
                                            for i, n in enumerate(numels)])


# (layout learner b joins with, substrings its rejection must name)
JOIN_MISMATCHES: dict[str, tuple[pb.Layout, tuple[str, ...]]] = {
    "other hash": (_layout("layout-v2", NUMEL, NUMEL), ("layout hash", "'layout-v2'", HASH)),
    "more fragments": (_layout(HASH, NUMEL, NUMEL, NUMEL), ("3 fragments", "2 fragments")),
    # Same hash and fragment count: only the sizes can explain the refusal.
    "other numel": (_layout(HASH, NUMEL, 1234), ("fragment 1", "1234", str(NUMEL))),
}


@pytest.mark.parametrize("mismatch", list(JOIN_MISMATCHES))
def test_join_with_another_layout_is_failed_precondition(start_daemon: StartDaemon,
                                                         mismatch: str) -> None:
    layout, needles = JOIN_MISMATCHES[mismatch]
    daemon = started(start_daemon)
    expect_rejected(daemon, partial(join, daemon, "b", layout=layout),
                    grpc.StatusCode.FAILED_PRECONDITION, Reason.LAYOUT_MISMATCH, *needles)
    assert [lr.learner_id for lr in daemon.status().learners] == ["a"]
    join(daemon, "b")


def test_join_against_a_pinned_layout_hash_is_failed_precondition(
        start_daemon: StartDaemon) -> None:
    daemon = start_daemon(*FAST, "--set", f'layout_hash="{HASH}"')
    expect_rejected(daemon, partial(join, daemon, layout=_layout("layout-v2", NUMEL, NUMEL)),
                    grpc.StatusCode.FAILED_PRECONDITION, Reason.LAYOUT_MISMATCH,
                    "'layout-v2'", HASH, learner_id=None)
    assert daemon.status().run_id == ""
    join(daemon)
    init(daemon)


def test_a_layout_too_large_to_hold_is_refused_before_anything_is_allocated(
        start_daemon: StartDaemon) -> None:
    daemon = start_daemon(*FAST)
    huge = _layout(HASH, 2**40, NUMEL)
    expect_rejected(daemon, partial(join, daemon, layout=huge),
                    grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.OVERSIZE,
                    f"{2**40 + NUMEL:,} parameters", "GB of memory", learner_id=None)
    assert daemon.status().run_id == ""
    join(daemon)
    init(daemon)
    capped = start_daemon(*FAST, "--set", "limits.max_params=1500")
    expect_rejected(capped, partial(join, capped), grpc.StatusCode.RESOURCE_EXHAUSTED,
                    Reason.OVERSIZE, "2,000 parameters", "most 1,500", "limits.max_params",
                    learner_id=None)


def test_a_state_directory_of_another_layout_than_the_pinned_one_is_not_resumed(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    daemon = start_daemon(*FAST, state_dir=tmp_path / "run")
    join(daemon)
    daemon.stop()
    pinned = Daemon(state_dir=tmp_path / "run", args=[*FAST, "--set", 'layout_hash="other"'])
    with pytest.raises(RuntimeError, match="exited with 1"):
        pinned.start()
    log = (tmp_path / "run.stderr.log").read_text()
    assert f"layout {HASH!r}, but layout_hash pins 'other'" in log, log[-1000:]


def test_push_with_another_layout_hash_is_failed_precondition(
        start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    expect_rejected(daemon, partial(push, daemon, layout_hash="layout-v2"),
                    grpc.StatusCode.FAILED_PRECONDITION, Reason.LAYOUT_MISMATCH,
                    "layout hash", "'layout-v2'")
    contribute_and_commit(daemon, seq=2)


# -- shape, byte count and encoding ------------------------------------------------------

HALF = NUMEL // 2
# case -> (push keyword arguments, substrings the message must hold)
Payloads = dict[str, tuple[dict[str, Any], tuple[str, ...]]]
BAD_SHAPES: Payloads = {
    "header numel": ({"numel": NUMEL + 1}, ("fragment 0", str(NUMEL), str(NUMEL + 1))),
    "chunk beyond the fragment": (
        {"chunks": [fp32_chunk(GRADIENT, 0, HALF),
                    pb.Chunk(offset=HALF, count=HALF + 8, scale=1.0,
                             data=bytes(4 * (HALF + 8)))]},
        (f"offset {HALF}", str(HALF + 8), f"fragment 0 of {NUMEL}")),
    "stream ends early": ({"chunks": [fp32_chunk(GRADIENT, 0, HALF)]},
                          (f"{HALF} of {NUMEL}", "fragment 0")),
    "header only": ({"chunks": []}, (f"0 of {NUMEL}", "fragment 0")),
    "empty chunk": ({"chunks": [pb.Chunk(offset=0, count=0, scale=1.0, data=b"")]},
                    ("offset 0", "0 elements")),
}
BAD_ENCODINGS: Payloads = {
    "byte count": (
        {"chunks": [pb.Chunk(offset=0, count=NUMEL, scale=1.0, data=GRADIENT.tobytes()[:-1])]},
        ("fp32", str(4 * NUMEL), str(4 * NUMEL - 1))),
    "bf16 bytes declared fp32": (
        {"chunks": list(iter_chunks(GRADIENT, codec_named("bf16")))},
        ("fp32", str(4 * NUMEL), str(2 * NUMEL))),
    "unknown codec": ({"codec": 9}, ("codec", "9")),
    "negative int8 scale": (
        {"codec": "int8",
         "chunks": [pb.Chunk(offset=0, count=NUMEL, scale=-1.0, data=bytes(NUMEL))]},
        ("int8", "scale")),
}
OUT_OF_ORDER: Payloads = {
    "second half first": (
        {"chunks": [fp32_chunk(GRADIENT, HALF, HALF), fp32_chunk(GRADIENT, 0, HALF)]},
        (f"offset {HALF}", "expected offset 0")),
    "chunk repeated": (
        {"chunks": [fp32_chunk(GRADIENT, 0, HALF), fp32_chunk(GRADIENT, 0, HALF)]},
        ("offset 0", f"expected offset {HALF}")),
    "gap": (
        {"chunks": [fp32_chunk(GRADIENT, 0, HALF - 8), fp32_chunk(GRADIENT, HALF, HALF)]},
        (f"offset {HALF}", f"expected offset {HALF - 8}")),
}


def check_payloads(daemon: Daemon, payloads: Payloads, reason: Reason) -> None:
    """Each bad payload is refused; then the same seq, pushed properly, commits."""
    for seq, (case, (fields, needles)) in enumerate(payloads.items(), start=2):
        bad = {"seq": seq, "base_version": version(daemon), **fields}
        expect_rejected(daemon, partial(push, daemon, **bad), INVALID_ARGUMENT, reason,
                        *needles, case=case)
        contribute_and_commit(daemon, seq=seq)


def test_bad_shape_is_invalid_argument(start_daemon: StartDaemon) -> None:
    check_payloads(started(start_daemon), BAD_SHAPES, Reason.BAD_SHAPE)


def test_bad_encoding_is_invalid_argument(start_daemon: StartDaemon) -> None:
    check_payloads(started(start_daemon), BAD_ENCODINGS, Reason.BAD_ENCODING)


def test_a_pull_in_an_unknown_codec_is_invalid_argument(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    expect_rejected(daemon, partial(pull, daemon, codec=cast(pb.Codec, 9)),
                    INVALID_ARGUMENT, Reason.BAD_ENCODING, "unknown codec value 9")


def test_chunks_out_of_order_are_invalid_argument(start_daemon: StartDaemon) -> None:
    check_payloads(started(start_daemon), OUT_OF_ORDER, Reason.MALFORMED)


# -- values ----------------------------------------------------------------------------

NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def test_non_finite_element_is_named(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    seq = 2
    for codec in ("fp32", "bf16"):
        for name, value in NON_FINITE.items():
            bad = GRADIENT.copy()
            bad[3] = value
            expect_rejected(daemon, partial(push, daemon, bad, codec=codec, seq=seq,
                                            base_version=version(daemon)),
                            INVALID_ARGUMENT, Reason.NOT_FINITE, "element 3", "fragment 0",
                            "finite", case=f"{name} in {codec}")
            contribute_and_commit(daemon, seq=seq)
            seq += 1


def test_non_finite_initial_value_is_rejected(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    bad = INITIAL.copy()
    bad[7] = np.nan
    expect_rejected(daemon, partial(init, daemon, fragment=1, seq=2, values=bad),
                    INVALID_ARGUMENT, Reason.NOT_FINITE, "element 7", "fragment 1")
    assert version(daemon, 1) == -1
    init(daemon, fragment=1, seq=2)
    assert version(daemon, 1) == 0


def test_norm_beyond_the_bound_is_rejected(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon, "--set", "limits.norm_bound=10")
    big = np.ones(NUMEL, np.float32)  # norm √1000 ≈ 31.6
    expect_rejected(daemon, partial(push, daemon, big, seq=2), INVALID_ARGUMENT,
                    Reason.NORM_BOUND, "norm", "31.6", "limits.norm_bound", case="bound")
    contribute_and_commit(daemon, seq=2)
    huge = np.full(NUMEL, 1e30, np.float32)  # finite, but Σx² overflows fp32
    expect_rejected(daemon, partial(push, daemon, huge, seq=3, base_version=1),
                    INVALID_ARGUMENT, Reason.NORM_BOUND, "norm", case="overflow")
    contribute_and_commit(daemon, seq=3)


# -- contribution ids, versions and counts ------------------------------------------------


def test_replay_into_the_open_round_is_already_exists(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon, "--min-quorum", "2")
    push(daemon, seq=2)
    assert list(daemon.status().fragments[0].round_learners) == ["a"]
    expect_rejected(daemon, partial(push, daemon, seq=2), grpc.StatusCode.ALREADY_EXISTS,
                    Reason.REPLAYED, "a/0/2", "open round")
    join(daemon, "b")
    push(daemon, learner_id="b", seq=1)
    wait_until(lambda: version(daemon) == 1, timeout=10, message="version 1")
    assert daemon.status().fragments[0].merged_contributions == 2


def test_replay_of_a_merged_contribution_is_already_exists(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    contribute_and_commit(daemon, seq=2)
    expect_rejected(daemon, partial(push, daemon, seq=2, base_version=1),
                    grpc.StatusCode.ALREADY_EXISTS, Reason.REPLAYED, "a/0/2",
                    "already merged")
    contribute_and_commit(daemon, seq=3)


def test_reusing_the_seq_of_the_initial_value_is_already_exists(
        start_daemon: StartDaemon) -> None:
    # The init push took contribution id a/0/1: PushHeader.seq is the id of every push,
    # and JoinResponse.next_seq promises a learner's ids are never reused.
    daemon = started(start_daemon)
    expect_rejected(daemon, partial(push, daemon, seq=1), grpc.StatusCode.ALREADY_EXISTS,
                    Reason.REPLAYED, "a/0/1")
    contribute_and_commit(daemon, seq=2)


def test_seq_zero_is_refused_cleanly(start_daemon: StartDaemon) -> None:
    # Join hands out sequence numbers from 1; 0 is what an unset field reads as. Either
    # reason is fair, but it must be a counted refusal naming the seq, not a crash.
    daemon = started(start_daemon)
    before = state(daemon)
    counts = rejections(daemon)
    with pytest.raises(grpc.RpcError) as info:
        push(daemon, seq=0)
    error: Any = info.value
    assert error.code() in (grpc.StatusCode.ALREADY_EXISTS, INVALID_ARGUMENT), (
        f"got {error.code()}: {error.details()!r}")
    assert "seq" in (error.details() or "")
    after = rejections(daemon)
    assert sum(after.values()) == sum(counts.values()) + 1
    refused = (Reason.REPLAYED.value, Reason.MALFORMED.value)
    assert sum(after[r] for r in refused) == sum(counts[r] for r in refused) + 1
    assert state(daemon) == before
    contribute_and_commit(daemon, seq=2)


def test_a_seq_that_leaves_no_next_one_is_refused(start_daemon: StartDaemon) -> None:
    """Found by the fuzzer (test_fuzz.py): a push (an initial value, or a contribution)
    with seq 2^64-1 was taken, and from then on every Join of its learner ended in
    UNKNOWN, since the next seq it is handed, 2^64, does not fit the uint64 of
    `JoinResponse.next_seq`."""
    daemon = started(start_daemon)
    last = 2**64 - 1
    for case, refused in (("initial value", partial(init, daemon, fragment=1, seq=last)),
                          ("contribution", partial(push, daemon, seq=last))):
        expect_rejected(daemon, refused, INVALID_ARGUMENT, Reason.MALFORMED, "seq",
                        f"got {last}", case=case)
    assert join(daemon).next_seq == 2
    contribute_and_commit(daemon, seq=last - 1)
    assert join(daemon).next_seq == last

def test_version_from_the_future_is_failed_precondition(start_daemon: StartDaemon) -> None:
    """Refused because of the state it met (the fragment's current version), as stale
    is: the same push may be right once the version exists."""
    daemon = started(start_daemon)
    expect_rejected(daemon, partial(push, daemon, base_version=5),
                    grpc.StatusCode.FAILED_PRECONDITION, Reason.FUTURE_VERSION,
                    "base version 5", "fragment 0", "current version 0")
    # A pull for something newer than a version it cannot have yet is refused at once,
    # not held for its wait.
    expect_rejected(daemon, partial(pull, daemon, have_version=5, wait_ms=30_000),
                    grpc.StatusCode.FAILED_PRECONDITION, Reason.FUTURE_VERSION,
                    "have_version 5",
                    "current version 0", case="pull")
    contribute_and_commit(daemon, seq=2)


def test_negative_base_version_is_invalid_argument(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    expect_rejected(daemon, partial(push, daemon, base_version=-3), INVALID_ARGUMENT,
                    Reason.MALFORMED, "base version -3")
    contribute_and_commit(daemon, seq=2)


def test_contribution_beyond_max_staleness_is_failed_precondition(
        start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon, "--set", "policy.max_staleness=0")
    contribute_and_commit(daemon, seq=2)
    expect_rejected(daemon, partial(push, daemon, seq=3, base_version=0),
                    grpc.StatusCode.FAILED_PRECONDITION, Reason.STALE, "base version 0",
                    "max_staleness 0", "pull fragment 0")
    contribute_and_commit(daemon, seq=3)


def test_contribution_to_an_uninitialized_fragment_is_failed_precondition(
        start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    expect_rejected(daemon, partial(push, daemon, fragment=1),
                    grpc.StatusCode.FAILED_PRECONDITION, Reason.NOT_INITIALIZED,
                    "fragment 1", "init")
    init(daemon, fragment=1, seq=2)
    contribute_and_commit(daemon, seq=3, fragment=1)


def test_zero_counts_are_invalid_argument(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    cases = {"c_tokens": {"c_tokens": 0}, "c_steps": {"c_steps": 0},
             "both": {"c_tokens": 0, "c_steps": 0}}
    for seq, (case, counts) in enumerate(cases.items(), start=2):
        expect_rejected(daemon, partial(push, daemon, seq=seq, base_version=version(daemon),
                                        **counts),
                        INVALID_ARGUMENT, Reason.BAD_COUNTS, *counts, "positive", case=case)
        contribute_and_commit(daemon, seq=seq)


def test_token_counts_whose_weight_fp32_cannot_carry_are_refused(
        start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    expect_rejected(daemon, partial(push, daemon, seq=2, c_tokens=2**62, c_steps=1),
                    INVALID_ARGUMENT, Reason.BAD_COUNTS, str(2**62), "2^64")
    # The largest weight taken merges like any other, though its values square past fp32.
    weight_ok = {"c_tokens": 2**32, "c_steps": 1}
    response = push(daemon, np.full(NUMEL, 0.5, np.float32), seq=3, **weight_ok)
    assert response.weight == pytest.approx(2.0**64)
    wait_until(lambda: version(daemon) == 1, timeout=10, message="the heavy push to commit")


def test_second_initial_value_is_already_exists(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    join(daemon, "b")
    expect_rejected(daemon, partial(init, daemon, learner_id="b", seq=1,
                                    values=np.zeros(NUMEL, np.float32)),
                    grpc.StatusCode.ALREADY_EXISTS, Reason.ALREADY_INITIALIZED,
                    "fragment 0", "version 0")
    contribute_and_commit(daemon, seq=2)


def test_initial_value_not_in_fp32_is_invalid_argument(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    expect_rejected(daemon, partial(push, daemon, INITIAL, fragment=1, init=True, codec="bf16"),
                    INVALID_ARGUMENT, Reason.BAD_ENCODING, "fp32")
    assert version(daemon, 1) == -1
    init(daemon, fragment=1, seq=2)


# -- stream structure and size -----------------------------------------------------------

GOOD_CHUNKS = [pb.PushMessage(chunk=c) for c in iter_chunks(GRADIENT, FP32)]
STREAMS: dict[str, tuple[list[pb.PushMessage], tuple[str, ...]]] = {
    "empty": ([], ("starts with a header",)),
    "chunk first": (GOOD_CHUNKS, ("starts with a header",)),
    "two headers": ([pb.PushMessage(header=header(seq=2)), pb.PushMessage(header=header(seq=2)),
                     *GOOD_CHUNKS], ("one header",)),
}


def test_malformed_stream_is_invalid_argument(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    for case, (messages, needles) in STREAMS.items():
        expect_rejected(daemon, partial(send, daemon, messages), INVALID_ARGUMENT,
                        Reason.MALFORMED, *needles, case=case)
    contribute_and_commit(daemon, seq=2)


def test_oversize_chunk_is_resource_exhausted(start_daemon: StartDaemon) -> None:
    daemon = started(start_daemon)
    size = MAX_CHUNK_BYTES + (1 << 20)  # over our limit, under gRPC's
    oversize = pb.Chunk(offset=0, count=NUMEL, scale=1.0, data=bytes(size))
    expect_rejected(daemon, partial(push, daemon, chunks=[oversize]),
                    grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.OVERSIZE,
                    str(size), f"limit is {MAX_CHUNK_BYTES}")
    contribute_and_commit(daemon, seq=2)


def test_a_push_cut_short_is_counted_as_cut_not_as_a_bad_shape(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    """A learner that cancels its push (or dies) mid-stream or before its header,
    and a message over gRPC's own size limit (which gRPC refuses before the daemon
    reads it), all end the push stream early, like a push that sent too little;
    none is the learner's malformed push, so none counts as a rejection."""
    log, port = tmp_path / "events.jsonl", free_port()
    daemon = started(start_daemon, "--event-log", str(log), "--prometheus-listen", str(port))
    before, counts = state(daemon), rejections(daemon)
    sent, cancelled = threading.Event(), threading.Event()

    def cut_off() -> Iterator[pb.PushMessage]:
        yield pb.PushMessage(header=pb.PushHeader(
            learner_id="a", fragment=0, layout_hash=HASH, seq=2, base_version=0,
            c_tokens=1, c_steps=1, numel=NUMEL))
        yield pb.PushMessage(chunk=fp32_chunk(GRADIENT, 0, HALF))
        sent.set()
        cancelled.wait(RPC_TIMEOUT)

    channel, synchronizer = stub(daemon)
    with channel:
        call = synchronizer.PushFragment.future(cut_off())
        assert sent.wait(RPC_TIMEOUT)
        headless = synchronizer.PushFragment.future(silent_until(cancelled))
        wait_until(lambda: push_streams_open(port) == 2, timeout=10,
                   message="the daemon's handlers taking both calls up")
        assert not call.done() and not headless.done()  # each waits for the rest
        call.cancel()
        headless.cancel()
    cancelled.set()
    too_big = 2 * MAX_CHUNK_BYTES + (1 << 20)  # over gRPC's limit on the daemon (8 MiB)
    with pytest.raises(grpc.RpcError) as refused:
        push(daemon, chunks=[pb.Chunk(offset=0, count=NUMEL, scale=1.0, data=bytes(too_big))],
             seq=3, base_version=0)
    error: Any = refused.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (error.details() or ""), error.details()
    wait_until(lambda: log.read_text().count('"push_cut"') == 3, timeout=10,
               message="the three cut pushes in the event log")
    assert rejections(daemon) == counts
    assert state(daemon) == before
    contribute_and_commit(daemon, seq=4)


def test_an_embedded_coordinator_takes_no_replicated_versions(
        start_daemon: StartDaemon) -> None:
    """Only a replica of a highly available run follows a leader: an embedded
    daemon that served `Replicate` let any client step it down and overwrite its
    fragments."""
    daemon = started(start_daemon)
    before = state(daemon)
    record = FragmentRecord(0, 99, np.ones(NUMEL, np.float32), np.zeros(NUMEL, np.float32),
                            {}, [], 1)
    run = RunRecord("x", HASH, (NUMEL,))
    with grpc.insecure_channel(daemon.address) as channel, \
            pytest.raises(grpc.RpcError) as refused:
        pb_grpc.ReplicationStub(channel).Replicate(
            replica_messages(1, "intruder", run, record), timeout=RPC_TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert state(daemon) == before
    contribute_and_commit(daemon, seq=2)


# -- metrics --------------------------------------------------------------------------


def test_rejections_reach_prometheus_with_their_reason(start_daemon: StartDaemon) -> None:
    port = free_port()
    daemon = started(start_daemon, "--prometheus-listen", str(port))  # on 127.0.0.1
    bad = GRADIENT.copy()
    bad[0] = np.nan
    expect_rejected(daemon, partial(push, daemon, bad), INVALID_ARGUMENT, Reason.NOT_FINITE,
                    "element 0")
    text = metrics_text(port)
    samples = [line for line in text.splitlines()
               if line.startswith("ftsync_rejections") and 'reason="not_finite"' in line]
    assert samples, f"no ftsync_rejections sample with reason not_finite in:\n{text}"
    assert any(float(line.rsplit(" ", 1)[1]) == 1.0 for line in samples), samples


def test_time_histograms_have_buckets_that_fit_what_they_measure(
        start_daemon: StartDaemon) -> None:
    """With the SDK's default buckets (0, 5, 10, ...) every quorum wait, grace window and
    sync time of a healthy run lands in le="5.0"; the views give each its own range."""
    port = free_port()
    daemon = started(start_daemon, "--prometheus-listen", str(port))  # on 127.0.0.1
    contribute_and_commit(daemon, seq=2)
    text = metrics_text(port)

    def bucket(metric: str, le: str) -> float:
        lines = [line for line in text.splitlines()
                 if line.startswith(f"{metric}_bucket{{") and f'le="{le}"' in line]
        assert lines, f"no {metric} bucket le={le} in:\n{text}"
        return float(lines[0].rsplit(" ", 1)[1])

    # One learner: quorum at once, staleness 0, the round closed when it contributed.
    assert bucket("ftsync_quorum_wait_seconds", "0.0") == 1.0
    assert bucket("ftsync_quorum_wait_seconds", "0.001") == 1.0
    assert bucket("ftsync_staleness", "0.0") == 1.0
    # No step time known yet: the grace granted is grace_max_s (0.2 s here).
    assert bucket("ftsync_grace_seconds", "0.1") == 0.0
    assert bucket("ftsync_grace_seconds", "0.25") == 1.0
    assert bucket("ftsync_sync_time_seconds", "30.0") == 1.0
    rounds = [line for line in text.splitlines()
              if line.startswith("ftsync_rounds_committed_total{")]
    assert any('why="all_live"' in line for line in rounds), rounds
