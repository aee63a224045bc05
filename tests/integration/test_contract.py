"""The contract of docs/protocol.md against a real daemon, with bare gRPC stubs.

What a learner written from the guide relies on and no other test pins down: a call
to another version of the contract is refused naming both versions; a replayed push
says the learner's merged seq.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest

from coordinator.errors import Reason
from protos import ftsync_pb2 as pb
from protos import metadata
from tests.daemon import Daemon
from tests.integration.test_bad_input import (
    FAST,
    init,
    join,
    push,
    rejections,
)

StartDaemon = Callable[..., Daemon]


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

