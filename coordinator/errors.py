"""Why the synchronizer refuses something.

One small vocabulary of rejection reasons, shared by the policy core (which
must not import grpc), the fragment store and the gRPC shell. The shell maps
each reason to a gRPC status code in one place (`coordinator.service`), and
the reason's value is the label the rejection metrics are counted under.
"""

from __future__ import annotations

import enum

from protos.metadata import LEADER


class Reason(enum.Enum):
    UNAUTHENTICATED = "unauthenticated"
    UNKNOWN_LEARNER = "unknown_learner"
    UNKNOWN_FRAGMENT = "unknown_fragment"
    LAYOUT_MISMATCH = "layout_mismatch"
    NOT_INITIALIZED = "not_initialized"
    ALREADY_INITIALIZED = "already_initialized"
    FUTURE_VERSION = "future_version"
    STALE = "stale"
    REPLAYED = "replayed"
    BAD_COUNTS = "bad_counts"
    BAD_SHAPE = "bad_shape"
    BAD_ENCODING = "bad_encoding"
    NOT_FINITE = "not_finite"
    NORM_BOUND = "norm_bound"
    OVERSIZE = "oversize"
    MALFORMED = "malformed"
    # High availability: this replica is a standby, or a newer leader exists.
    NOT_LEADER = "not_leader"
    STALE_EPOCH = "stale_epoch"
    # A push stream that sent nothing for limits.push_idle_s: cut, not refused.
    IDLE = "idle"
    # This replica is draining (Admin.Drain): a push that would open a round goes
    # to the next leader, or waits for this one to come back, as for not_leader.
    DRAINING = "draining"
    # A leader asked to drain has no in-sync standby to hand the run to.
    NO_STANDBY = "no_standby"
    # A call to another version of the contract (another protobuf package).
    VERSION_MISMATCH = "version_mismatch"
    # The bulk channel: a connection whose ticket is missing, unknown, spent,
    # expired or another learner's; a frame that fails its checksum; a push whose
    # bulk connection broke before its last frame, or a compressed pull whose
    # reference's advance failed while it streamed (cut, not refused).
    BAD_TICKET = "bad_ticket"
    CORRUPT = "corrupt"
    CUT = "cut"


class Rejected(Exception):
    """A request refused with a reason; raised before any state changes.

    `facts` travel beside the reason as trailing metadata (`protos.metadata`
    names the keys): what a client acts on, so it never reads the message."""

    def __init__(self, reason: Reason, message: str,
                 facts: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.facts = facts

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.message}"


class NotLeader(Rejected):
    """This replica does not lead; `leader` is where the learner should go."""

    def __init__(self, leader: str, epoch: int) -> None:
        where = (f"leader is {leader} (epoch {epoch})" if leader
                 else "no leader is elected yet; retry shortly")
        super().__init__(Reason.NOT_LEADER, where, ((LEADER, leader),) if leader else ())
        self.leader = leader
        self.epoch = epoch


class Cut(Rejected):
    """A push the daemon cut off rather than refused: it is counted as cut where it
    was cut, never as a rejection, and its learner sends it again."""
