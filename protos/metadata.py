"""The part of the wire contract that is gRPC metadata rather than protobuf.

A refusal ends its call with a gRPC status and, in trailing metadata, the
machine-readable reason code (`ftsync-reason`, the same label the
coordinator's metrics count it under) and, for some reasons, one fact a
client acts on: the leader a standby names (`ftsync-leader`), the learner's
merged seq for a replayed contribution (`ftsync-merged-seq`). The message is
for people; clients branch on these keys. The coordinator's gRPC shell
(`coordinator.service`) writes them, learners (`learner.client`) and the
operator's commands (`coordinator.admin`) read them, through this module.
It imports nothing of gRPC or protobuf, so the policy core may name a key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

# Trailing metadata of a refusal.
REASON: Final = "ftsync-reason"
LEADER: Final = "ftsync-leader"
MERGED_SEQ: Final = "ftsync-merged-seq"
# Initial metadata of a push asked with `bulk`: its ticket (hex) and the bulk port.
BULK_TICKET: Final = "ftsync-bulk-ticket"
BULK_PORT: Final = "ftsync-bulk-port"


def trailing(error: Any, key: str) -> str:
    """The value of `key` in a failed call's trailing metadata, "" when absent.

    `error` is a `grpc.RpcError` (sync or asyncio); one that carries no
    metadata (a connection that failed before any answer) has none."""
    read = getattr(error, "trailing_metadata", None)
    items: Iterable[Any] = (read() if callable(read) else None) or ()
    for name, value in items:
        if name == key and isinstance(value, str):
            return value
    return ""


def reason(error: Any) -> str:
    """The coordinator's reason code of a refused call (`stale`, `not_leader`, ...);
    "" for a failure the coordinator did not decide (unreachable, cancelled)."""
    return trailing(error, REASON)
