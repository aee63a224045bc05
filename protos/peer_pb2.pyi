from protos import ftsync_pb2 as _ftsync_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerFetchRequest(_message.Message):
    __slots__ = ("run_id", "layout_hash", "fragment", "version", "commit_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    layout_hash: str
    fragment: int
    version: int
    commit_id: int
    def __init__(self, run_id: _Optional[str] = ..., layout_hash: _Optional[str] = ..., fragment: _Optional[int] = ..., version: _Optional[int] = ..., commit_id: _Optional[int] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("fragment", "version", "numel", "ticket", "bulk_port", "expires_ms", "commit_id")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_MS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ID_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    numel: int
    ticket: bytes
    bulk_port: int
    expires_ms: int
    commit_id: int
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., ticket: _Optional[bytes] = ..., bulk_port: _Optional[int] = ..., expires_ms: _Optional[int] = ..., commit_id: _Optional[int] = ...) -> None: ...

class HoldingsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Holdings(_message.Message):
    __slots__ = ("run_id", "layout_hash", "fragments")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    layout_hash: str
    fragments: _containers.RepeatedCompositeFieldContainer[_ftsync_pb2.FragmentStatus]
    def __init__(self, run_id: _Optional[str] = ..., layout_hash: _Optional[str] = ..., fragments: _Optional[_Iterable[_Union[_ftsync_pb2.FragmentStatus, _Mapping]]] = ...) -> None: ...
