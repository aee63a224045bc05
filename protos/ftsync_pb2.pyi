from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_FP32: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_INT8: _ClassVar[Codec]
    CODEC_E3M0: _ClassVar[Codec]
CODEC_FP32: Codec
CODEC_BF16: Codec
CODEC_INT8: Codec
CODEC_E3M0: Codec

class FragmentSpec(_message.Message):
    __slots__ = ("fragment", "numel")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    numel: int
    def __init__(self, fragment: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("hash", "fragments")
    HASH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    hash: str
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentSpec]
    def __init__(self, hash: _Optional[str] = ..., fragments: _Optional[_Iterable[_Union[FragmentSpec, _Mapping]]] = ...) -> None: ...

class FragmentStatus(_message.Message):
    __slots__ = ("fragment", "version", "merged_seq", "commit_id")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MERGED_SEQ_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ID_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    merged_seq: int
    commit_id: int
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., merged_seq: _Optional[int] = ..., commit_id: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("learner_id", "layout", "overlap_steps", "host", "pid", "device", "auto_sync_every")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_STEPS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    AUTO_SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    layout: Layout
    overlap_steps: int
    host: str
    pid: int
    device: str
    auto_sync_every: bool
    def __init__(self, learner_id: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., overlap_steps: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., device: _Optional[str] = ..., auto_sync_every: bool = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("run_id", "fragments", "heartbeat_interval_ms", "chunk_bytes", "max_staleness", "next_seq", "epoch", "sync_every")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    heartbeat_interval_ms: int
    chunk_bytes: int
    max_staleness: int
    next_seq: int
    epoch: int
    sync_every: int
    def __init__(self, run_id: _Optional[str] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., heartbeat_interval_ms: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_staleness: _Optional[int] = ..., next_seq: _Optional[int] = ..., epoch: _Optional[int] = ..., sync_every: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "local_step", "backlog")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    local_step: int
    backlog: int
    def __init__(self, learner_id: _Optional[str] = ..., local_step: _Optional[int] = ..., backlog: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("run_id", "fragments", "epoch", "sync_every")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    epoch: int
    sync_every: int
    def __init__(self, run_id: _Optional[str] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., epoch: _Optional[int] = ..., sync_every: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("learner_id", "fragment", "layout_hash", "seq", "base_version", "c_tokens", "c_steps", "local_step", "codec", "numel", "init", "bulk")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    C_TOKENS_FIELD_NUMBER: _ClassVar[int]
    C_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment: int
    layout_hash: str
    seq: int
    base_version: int
    c_tokens: int
    c_steps: int
    local_step: int
    codec: Codec
    numel: int
    init: bool
    bulk: bool
    def __init__(self, learner_id: _Optional[str] = ..., fragment: _Optional[int] = ..., layout_hash: _Optional[str] = ..., seq: _Optional[int] = ..., base_version: _Optional[int] = ..., c_tokens: _Optional[int] = ..., c_steps: _Optional[int] = ..., local_step: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., numel: _Optional[int] = ..., init: bool = ..., bulk: bool = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "count", "scale", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    count: int
    scale: float
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., count: _Optional[int] = ..., scale: _Optional[float] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("seq", "target_version", "weight", "staleness", "epoch")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    target_version: int
    weight: float
    staleness: int
    epoch: int
    def __init__(self, seq: _Optional[int] = ..., target_version: _Optional[int] = ..., weight: _Optional[float] = ..., staleness: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("learner_id", "fragment", "have_version", "wait_ms", "bulk", "codec", "have_reference")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    HAVE_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment: int
    have_version: int
    wait_ms: int
    bulk: bool
    codec: Codec
    have_reference: int
    def __init__(self, learner_id: _Optional[str] = ..., fragment: _Optional[int] = ..., have_version: _Optional[int] = ..., wait_ms: _Optional[int] = ..., bulk: bool = ..., codec: _Optional[_Union[Codec, str]] = ..., have_reference: _Optional[int] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("fragment", "version", "numel", "not_modified", "merged_seq", "epoch", "commit_id", "ticket", "bulk_port", "codec", "delta", "deltas", "reference")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    NOT_MODIFIED_FIELD_NUMBER: _ClassVar[int]
    MERGED_SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ID_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    numel: int
    not_modified: bool
    merged_seq: int
    epoch: int
    commit_id: int
    ticket: bytes
    bulk_port: int
    codec: Codec
    delta: bool
    deltas: int
    reference: int
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., not_modified: bool = ..., merged_seq: _Optional[int] = ..., epoch: _Optional[int] = ..., commit_id: _Optional[int] = ..., ticket: _Optional[bytes] = ..., bulk_port: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., delta: bool = ..., deltas: _Optional[int] = ..., reference: _Optional[int] = ...) -> None: ...

class PullMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("learner_id",)
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    def __init__(self, learner_id: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("learner_id", "reason")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    reason: str
    def __init__(self, learner_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("learner_id", "live", "heartbeat_age_s", "step_time_s", "local_step", "contributions", "rejections", "bytes_in", "backlog", "host")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    live: bool
    heartbeat_age_s: float
    step_time_s: float
    local_step: int
    contributions: int
    rejections: int
    bytes_in: int
    backlog: int
    host: str
    def __init__(self, learner_id: _Optional[str] = ..., live: bool = ..., heartbeat_age_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., local_step: _Optional[int] = ..., contributions: _Optional[int] = ..., rejections: _Optional[int] = ..., bytes_in: _Optional[int] = ..., backlog: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class FragmentInfo(_message.Message):
    __slots__ = ("fragment", "version", "numel", "round_learners", "round_age_s", "grace_left_s", "commits", "merged_contributions", "last_commit_age_s")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    ROUND_LEARNERS_FIELD_NUMBER: _ClassVar[int]
    ROUND_AGE_S_FIELD_NUMBER: _ClassVar[int]
    GRACE_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    MERGED_CONTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMIT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    numel: int
    round_learners: _containers.RepeatedScalarFieldContainer[str]
    round_age_s: float
    grace_left_s: float
    commits: int
    merged_contributions: int
    last_commit_age_s: float
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., round_learners: _Optional[_Iterable[str]] = ..., round_age_s: _Optional[float] = ..., grace_left_s: _Optional[float] = ..., commits: _Optional[int] = ..., merged_contributions: _Optional[int] = ..., last_commit_age_s: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("run_id", "uptime_s", "min_quorum", "learners", "fragments", "bytes_in", "bytes_out", "rejections", "layout_hash", "role", "epoch", "leader", "replica_id", "draining")
    class RejectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    MIN_QUORUM_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    uptime_s: float
    min_quorum: int
    learners: _containers.RepeatedCompositeFieldContainer[LearnerStatus]
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentInfo]
    bytes_in: int
    bytes_out: int
    rejections: _containers.ScalarMap[str, int]
    layout_hash: str
    role: str
    epoch: int
    leader: str
    replica_id: str
    draining: bool
    def __init__(self, run_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., min_quorum: _Optional[int] = ..., learners: _Optional[_Iterable[_Union[LearnerStatus, _Mapping]]] = ..., fragments: _Optional[_Iterable[_Union[FragmentInfo, _Mapping]]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., rejections: _Optional[_Mapping[str, int]] = ..., layout_hash: _Optional[str] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., leader: _Optional[str] = ..., replica_id: _Optional[str] = ..., draining: bool = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("role", "rounds_committed", "rounds_left_open", "leader", "epoch")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_LEFT_OPEN_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    role: str
    rounds_committed: int
    rounds_left_open: _containers.RepeatedScalarFieldContainer[int]
    leader: str
    epoch: int
    def __init__(self, role: _Optional[str] = ..., rounds_committed: _Optional[int] = ..., rounds_left_open: _Optional[_Iterable[int]] = ..., leader: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("epoch", "leader_id", "run_id", "layout_hash", "numels", "fragment", "version", "numel", "watermarks", "manifest_json", "commit_epoch", "commit_id", "bulk", "zero_momentum")
    class WatermarksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUMELS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    WATERMARKS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    COMMIT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ID_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    ZERO_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    leader_id: str
    run_id: str
    layout_hash: str
    numels: _containers.RepeatedScalarFieldContainer[int]
    fragment: int
    version: int
    numel: int
    watermarks: _containers.ScalarMap[str, int]
    manifest_json: str
    commit_epoch: int
    commit_id: int
    bulk: bool
    zero_momentum: bool
    def __init__(self, epoch: _Optional[int] = ..., leader_id: _Optional[str] = ..., run_id: _Optional[str] = ..., layout_hash: _Optional[str] = ..., numels: _Optional[_Iterable[int]] = ..., fragment: _Optional[int] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., watermarks: _Optional[_Mapping[str, int]] = ..., manifest_json: _Optional[str] = ..., commit_epoch: _Optional[int] = ..., commit_id: _Optional[int] = ..., bulk: bool = ..., zero_momentum: bool = ...) -> None: ...

class ReplicaMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ReplicaHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[ReplicaHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("fragment", "version", "epoch")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    epoch: int
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...
