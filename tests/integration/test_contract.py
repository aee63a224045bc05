"""The contract of docs/protocol.md against a real daemon, with bare gRPC stubs.

What a learner written from the guide relies on and no other test pins down: a call
to another version of the contract is refused naming both versions; `next_seq` after
a coordinator crash is above every seq it acknowledged, in rounds the crash lost too;
a second push against the same base replaces the first, numerically (merged values
checked against the formula); a replayed push says the learner's merged seq.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

from coordinator.errors import Reason
from protos import ftsync_pb2 as pb
from protos import metadata
from tests.daemon import Daemon, wait_until
from tests.integration.test_bad_input import (
    FAST,
    NUMEL,
    init,
    join,
    pull,
    push,
    rejections,
    version,
)

StartDaemon = Callable[..., Daemon]
# The outer step is Θ ← Θ − Δ with these (not scaled per round), so a version shows
# the merge itself.
PLAIN_OUTER = ("--set", "outer.lr=1.0", "--set", "outer.momentum=0.0",
               "--set", "outer.nesterov=false", "--set", "outer.adaptive=false")


@pytest.mark.parametrize("method", ["/ftsync.v0.Synchronizer/Join",
                                    "/ftsync.Synchronizer/PushFragment",
                                    "/ftsync.v2.Admin/Status"])
def test_a_call_to_another_version_names_both(start_daemon: StartDaemon,
                                              method: str) -> None:
    daemon = start_daemon()
    package = method.strip("/").split("/")[0].rpartition(".")[0]
    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.unary_unary(method)
        with pytest.raises(grpc.RpcError) as info:
            call(b"", timeout=10)
    error: Any = info.value
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert metadata.reason(error) == Reason.VERSION_MISMATCH.value
    details = error.details() or ""
    assert pb.DESCRIPTOR.package in details and f"is {package}:" in details, details
    assert rejections(daemon)[Reason.VERSION_MISMATCH.value] == 1
    # This version's own unknown methods stay gRPC's plain UNIMPLEMENTED.
    unknown = f"/{pb.DESCRIPTOR.package}.Synchronizer/Nothing"
    with grpc.insecure_channel(daemon.address) as channel, \
            pytest.raises(grpc.RpcError) as info:
        channel.unary_unary(unknown)(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert metadata.reason(info.value) == ""


def test_next_seq_after_a_crash_is_above_a_seq_acknowledged_in_a_lost_round(
        start_daemon: StartDaemon, tmp_path: Any) -> None:
    state_dir = tmp_path / "state"
    daemon = start_daemon("--min-quorum", "2", *FAST, state_dir=state_dir)
    assert join(daemon).next_seq == 1
    join(daemon, "b")
    init(daemon)
    ack = push(daemon, seq=7)
    assert ack.target_version == 1  # held in the open round: b has not pushed
    daemon.kill()
    restarted = start_daemon("--min-quorum", "2", *FAST, state_dir=state_dir)
    # The round holding seq 7 died with the daemon and no watermark names it.
    assert version(restarted) == 0
    assert join(restarted).next_seq > 7


def test_a_second_push_against_the_same_base_replaces_the_first(
        start_daemon: StartDaemon) -> None:
    """Learner a pushes twice against version 0 while the round waits for b: the
    second carries its progress since the first, and the two count once, at the
    first's weight. Merged beside it at full weight (the old rule), a's work would
    weigh twice b's."""
    daemon = start_daemon("--min-quorum", "2", *PLAIN_OUTER, *FAST)
    join(daemon)
    join(daemon, "b")
    init(daemon)
    _, start = pull(daemon)
    rng = np.random.default_rng(3)
    first, second, other = (rng.standard_normal(NUMEL).astype(np.float32) * 0.01
                            for _ in range(3))
    a1 = push(daemon, first, seq=2, c_tokens=100, c_steps=10)
    a2 = push(daemon, second, seq=3, c_tokens=400, c_steps=10)
    assert a2.weight == a1.weight == pytest.approx(1000.0)
    assert a2.target_version == a1.target_version == 1
    b1 = push(daemon, other, learner_id="b", seq=1, c_tokens=100, c_steps=5)
    assert b1.weight == pytest.approx(2000.0)
    wait_until(lambda: version(daemon) == 1, timeout=10, message="version 1")
    head, merged = pull(daemon)
    delta = (a1.weight * (first + second) + b1.weight * other) / (a1.weight + b1.weight)
    np.testing.assert_allclose(merged, start - delta, rtol=1e-5, atol=1e-7)
    assert head.merged_seq == 3  # the replaced seq 2 is merged too: below the watermark


def test_a_replayed_push_says_the_merged_seq(start_daemon: StartDaemon) -> None:
    daemon = start_daemon("--min-quorum", "2", *FAST)
    join(daemon)
    join(daemon, "b")
    init(daemon)
    push(daemon, seq=2)
    for seq, merged in ((2, "1"), (1, "1")):  # held by the open round; the init's seq
        with pytest.raises(grpc.RpcError) as info:
            push(daemon, seq=seq)
        error: Any = info.value
        assert error.code() == grpc.StatusCode.ALREADY_EXISTS
        assert metadata.reason(error) == Reason.REPLAYED.value
        assert metadata.trailing(error, metadata.MERGED_SEQ) == merged

