"""The coordinator's configuration: one tree of frozen dataclasses.

Loaded from TOML, overridden by `--set key=value` flags, validated before
the daemon touches anything, and printed once at start-up. Errors name the
dotted key and, when it came from the file, its line. The loader is generic
over dataclass trees, so experiment files in `chaos/` use it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from coordinator.policy import PolicyConfig
from protos.settings import check
from protos.tls import TlsConfig

T = TypeVar("T")

MIB = 1 << 20


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names key and line."""


@dataclass(frozen=True)
class OuterConfig:
    """Per-fragment outer SGD (Nesterov when momentum is set, as in DiLoCo)."""

    lr: float = 0.7
    # DiLoCo's 0.9 steps 3-7 times as far as the learners moved (the momentum sums a
    # run of aligned outer gradients); on the built-in tasks it diverged in lock-step
    # rounds at every H tried (5 to 500) and lost to none in every other measured
    # setting (BENCHMARKS.md "Outer defaults"). 0: each round steps lr of its merge.
    momentum: float = 0.0
    nesterov: bool = True
    # Scale lr and momentum per round by `RoundClose.step_scale` (the share of live
    # learners merged over one plus the mean staleness), so that DiLoCo's values,
    # made for lock-step rounds, also converge at a small quorum; false: as given.
    adaptive: bool = True

    def scaled(self, scale: float) -> OuterConfig:
        """The settings one round steps with (`adaptive`: lr and momentum × scale)."""
        if not self.adaptive or scale == 1.0:
            return self
        return dataclasses.replace(self, lr=self.lr * scale, momentum=self.momentum * scale)

    def __post_init__(self) -> None:
        check(self, [(0 < self.lr < math.inf, "lr", "must be > 0 and finite"),
                     (0 <= self.momentum < 1, "momentum", "must be in [0, 1)")], "outer.")


@dataclass(frozen=True)
class LimitsConfig:
    """What a single request may carry."""

    # Largest L2 norm of an outer gradient; 0 disables the bound.
    norm_bound: float = 1.0e4
    # Chunk size the daemon streams pulls in.
    chunk_bytes: int = 2 * MIB
    # Bytes of fragment staging shared by concurrent pushes; 0: twice the
    # largest fragment. Pushes beyond it wait, so memory stays flat.
    staging_bytes: int = 0
    # Seconds a push stream may send nothing (no chunk) before it is cut and
    # its staging passed on: a stuck learner must not hold it for ever. Raise
    # it where one chunk takes longer than this to arrive.
    push_idle_s: float = 30.0
    # Parameters a run may have; 0: as many as fit in this machine's memory at
    # about 12 bytes each (parameters, momentum, one open round's sum).
    max_params: int = 0

    def __post_init__(self) -> None:
        check(self, [
            # NaN fails too: it would switch the bound off.
            (self.norm_bound >= 0, "norm_bound", "must be >= 0"),
            (self.max_params >= 0, "max_params", "must be >= 0"),
            (MIB <= self.chunk_bytes <= 4 * MIB, "chunk_bytes", "must be in [1 MiB, 4 MiB]"),
            (self.staging_bytes >= 0, "staging_bytes", "must be >= 0"),
            (0 < self.push_idle_s < math.inf, "push_idle_s", "must be > 0 and finite"),
        ], "limits.")


@dataclass(frozen=True)
class MetricsConfig:
    # HOST:PORT of the Prometheus scrape endpoint (/metrics), any interface (it
    # carries no learner data); a bare PORT listens on 127.0.0.1, port 0 on any
    # free port (printed at start); empty: none.
    prometheus_listen: str = ""
    # Seconds between console dumps of the metrics; 0 turns them off.
    console_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if self.prometheus_listen:
            self.prometheus_address()
        check(self, [(self.console_interval_s >= 0, "console_interval_s", "must be >= 0")],
              "metrics.")

    def prometheus_address(self) -> tuple[str, int]:
        """(host, port) of `prometheus_listen`; ValueError if it is neither HOST:PORT
        nor PORT."""
        host, colon, port = self.prometheus_listen.rpartition(":")
        host = host.strip("[]") if colon else "127.0.0.1"
        if not host or not port.isdigit() or int(port) > 65535 or any(
                c.isspace() for c in host):
            raise ValueError(f"metrics.prometheus_listen must be HOST:PORT or PORT (on "
                             f"127.0.0.1) with a port up to 65535 "
                             f"(got {self.prometheus_listen!r})")
        return host, int(port)


@dataclass(frozen=True)
class AuthConfig:
    """Bearer tokens per learner; with none configured anyone may join."""

    tokens: Mapping[str, str] = field(default_factory=dict)
    # TOML file with a [tokens] table, kept out of the main config.
    tokens_file: str = ""
    # Bearer token Admin.Status asks for (learner ids, hosts, rates); empty: open.
    admin_token: str = ""


ReplicationMode = Literal["none", "async", "sync"]


@dataclass(frozen=True)
class HaConfig:
    """High availability on etcd; with no endpoints the coordinator is embedded
    (one process, liveness from its own heartbeat table)."""

    # etcd client endpoints, HOST:PORT each; empty: no etcd, no replicas.
    etcd: tuple[str, ...] = ()
    # Keys of this run live under /ftsync/<run>/ in etcd.
    run: str = "default"
    # This replica's name among the run's replicas; empty: its advertise address.
    replica_id: str = ""
    # HOST:PORT learners and other replicas reach this replica at; empty: the
    # address it listens on (with the real port when listening on port 0).
    advertise: str = ""
    # Seconds a leader's lease lives without renewal; a leader stops committing
    # a third of it before the lease can expire.
    lease_ttl_s: int = 3
    # none: standbys get nothing; async: committed versions are streamed after
    # publishing; sync: published only once every in-sync standby has them.
    replication: ReplicationMode = "sync"
    # A standby that has not acknowledged a version within this is dropped
    # from the in-sync set (and re-synchronised when it comes back).
    replication_timeout_s: float = 2.0
    # Shared by the run's replicas: the leader sends it with each replicated
    # version and a standby refuses versions without it. Empty: any client that
    # reaches a replica may replicate to it, as any may push without auth.tokens.
    token: str = ""

    def __post_init__(self) -> None:
        for endpoint in self.etcd:
            if not re.fullmatch(r"[^\s:,]+:\d+", endpoint):
                raise ValueError(f"ha.etcd entries must be HOST:PORT (got {endpoint!r})")
        check(self, [
            (bool(re.fullmatch(r"[\w.-]+", self.run)), "run",
             "must be letters, digits, '.', '_' or '-'"),
            (not self.advertise or bool(re.fullmatch(r"[^\s:]+:\d+", self.advertise)),
             "advertise", "must be HOST:PORT"),
            (self.lease_ttl_s >= 2, "lease_ttl_s", "must be at least 2 (etcd's smallest lease)"),
            (self.replication_timeout_s > 0, "replication_timeout_s", "must be > 0"),
        ], "ha.")

    @property
    def enabled(self) -> bool:
        return bool(self.etcd)


@dataclass(frozen=True)
class CoordinatorConfig:
    listen: str = "127.0.0.1:50051"
    state_dir: str = "ftsync-state"
    # fsync every committed version before publishing it.
    fsync: bool = True
    heartbeat_interval_ms: int = 1000
    # Pin the run to one fragment layout; empty: the first learner's.
    layout_hash: str = ""
    # The bulk channel's TCP port, on the host of `listen`; 0: a free one at each start.
    # Fix it where only known ports reach the daemon (a Kubernetes Service, a compose
    # port map, a firewall): learners that cannot reach it send their bytes on gRPC.
    bulk_port: int = 0
    # JSONL event log (joins, pushes, commits) for the chaos checkers.
    event_log: str = ""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    ha: HaConfig = field(default_factory=HaConfig)
    # The coordinator's certificate serves learners, replicas and Admin; with tls.ca,
    # clients must present certificates (a learner's names its id) and replicas,
    # etcd and peers are reached with it too.
    tls: TlsConfig = field(default_factory=TlsConfig)

    def __post_init__(self) -> None:
        check(self, [
            (bool(re.fullmatch(r"[^\s:]*:\d+", self.listen))
             and int(self.listen.rsplit(":", 1)[1]) <= 65535,
             "listen", "must be HOST:PORT with a port up to 65535"),
            # Learners are told it in milliseconds as a 32-bit field.
            (0 < self.heartbeat_interval_ms <= 3_600_000, "heartbeat_interval_ms",
             "must be in (0, 3600000]"),
            (0 <= self.bulk_port <= 65535, "bulk_port", "must be in [0, 65535]"),
        ])

    def tokens(self) -> dict[str, str]:
        """Configured tokens, those of tokens_file included."""
        merged = dict(self.auth.tokens)
        if self.auth.tokens_file:
            path = Path(self.auth.tokens_file)
            try:
                data = tomllib.loads(path.read_text())
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"auth.tokens_file {path}: {exc}") from exc
            table = data.get("tokens")
            if not isinstance(table, dict) or not all(
                    isinstance(v, str) for v in table.values()):
                raise ConfigError(f"auth.tokens_file {path}: needs a [tokens] table of strings")
            merged.update(table)
        empty = sorted(learner for learner, token in merged.items() if not token)
        if empty:
            raise ConfigError(f"auth.tokens: the token of {', '.join(map(repr, empty))} is "
                              f"empty, which a learner sending no token would match")
        return merged


def load(cls: type[T], path: str | Path | None = None,
         overrides: Mapping[str, str] | None = None) -> T:
    """Build `cls` from a TOML file and `key=value` overrides (dotted keys)."""
    text = ""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from exc
    for dotted, raw in (overrides or {}).items():
        _set_dotted(data, dotted, _parse_override(raw))
    where = _Locator(str(path) if path else "", text, set(overrides or {}))
    return _build(cls, data, (), where)


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """`["a.b=1", ...]` from repeated `--set` flags into a mapping."""
    result: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects KEY=VALUE, got {pair!r}")
        result[key.strip()] = value.strip()
    return result


def describe(config: object) -> str:
    """The configuration as TOML-like lines, for the start-up banner."""
    lines: list[str] = []
    _describe(config, "", lines)
    return "\n".join(lines)


def _describe(obj: object, prefix: str, lines: list[str]) -> None:
    assert dataclasses.is_dataclass(obj)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _describe(value, key + ".", lines)
        elif key.startswith("auth.tokens") and isinstance(value, Mapping):
            lines.append(f"{key} = <{len(value)} learners>")
        elif key in ("ha.token", "auth.admin_token"):
            lines.append(f"{key} = {'<set>' if value else '<none>'}")
        else:
            lines.append(f"{key} = {value!r}")


class _Locator:
    """Finds the line a key was written on, for error messages."""

    def __init__(self, path: str, text: str, overridden: set[str]) -> None:
        self.path = path
        self.lines = text.splitlines()
        self.overridden = overridden

    def __call__(self, keys: tuple[str, ...]) -> str:
        if not self.path or ".".join(keys) in self.overridden:
            return "(from the command line)"
        if not keys:
            return f"({self.path})"
        # Tables are named by their header; the n-th [[array]] entry by index n.
        section = tuple(k for k in keys[:-1])
        current: tuple[str, ...] = ()
        arrays: dict[str, int] = {}
        for number, line in enumerate(self.lines, start=1):
            stripped = line.split("#", 1)[0].strip()
            header = re.fullmatch(r"(\[\[?)\s*([^\]]+?)\s*\]\]?", stripped)
            if header:
                name = header.group(2).replace('"', "")
                if header.group(1) == "[[":
                    arrays[name] = arrays.get(name, -1) + 1
                    current = (*name.split("."), str(arrays[name]))
                else:
                    current = tuple(name.split("."))
                if current == keys:  # the key is this table
                    return f"({self.path}, line {number})"
                continue
            if current == section and re.match(rf'"?{re.escape(keys[-1])}"?\s*=', stripped):
                return f"({self.path}, line {number})"
            if not current and re.match(rf"{re.escape('.'.join(keys))}\s*=", stripped):
                return f"({self.path}, line {number})"
        return f"({self.path})"


def _build(cls: type[T], data: Mapping[str, Any], prefix: tuple[str, ...],
           where: _Locator) -> T:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{'.'.join(prefix)} must be a table {where(prefix)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        keys = (*prefix, key)
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {'.'.join((*prefix, close[0]))!r}?" if close else ""
            raise ConfigError(f"unknown key {'.'.join(keys)!r} {where(keys)}{hint}")
        kwargs[key] = _coerce(hints[key], value, keys, where)
    missing = [name for name, f in fields.items() if name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        table = f"table {'.'.join(prefix)!r}" if prefix else "the file"
        raise ConfigError(f"{table} needs key {'.'.join((*prefix, missing[0]))!r} "
                          f"{where(prefix)}")
    try:
        return cls(**kwargs)
    except ValueError as exc:
        bad = _key_named_in(str(exc), prefix, data)
        dotted = ".".join(bad)
        named = str(exc) if dotted in str(exc) else f"{dotted}: {exc}"
        raise ConfigError(f"{named} {where(bad)}") from exc


def _key_named_in(message: str, prefix: tuple[str, ...],
                  data: Mapping[str, Any]) -> tuple[str, ...]:
    """The key a validation message is about: a dotted path it spells out, or a
    key of this table it names."""
    for dotted in re.findall(r"[A-Za-z_][\w-]*(?:\.[\w-]+)+", message):
        parts = tuple(dotted.split("."))
        relative = parts[len(prefix):]
        if parts[:len(prefix)] == prefix and relative and relative[0] in data:
            return parts
        if parts[0] in data:
            return (*prefix, *parts)
    for key in data:
        if re.search(rf"\b{re.escape(key)}\b", message):
            return (*prefix, key)
    return (*prefix, next(iter(data), ""))


def _coerce(hint: Any, value: Any, keys: tuple[str, ...], where: _Locator) -> Any:
    name = ".".join(keys)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, keys, where)  # type: ignore[arg-type]
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {list(allowed)} "
                              f"(got {value!r}) {where(keys)}")
        return value
    if origin in (Mapping, dict) or hint is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a table {where(keys)}")
        _, value_type = typing.get_args(hint) or (str, Any)
        return {str(k): _coerce(value_type, v, (*keys, str(k)), where) for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be an array {where(keys)}")
        (item_type, *_) = typing.get_args(hint) or (Any,)
        items = [_coerce(item_type, v, (*keys, str(i)), where) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (typing.Union, types.UnionType):
        # The first option the value fits (`int | Literal["auto"]`).
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        for option in options:
            with contextlib.suppress(ConfigError):
                return _coerce(option, value, keys, where)
        if len(options) == 1:
            return _coerce(options[0], value, keys, where)
        kinds = [f"one of {list(typing.get_args(a))}" if typing.get_origin(a) is Literal
                 else getattr(a, "__name__", str(a)) for a in options]
        raise ConfigError(f"{name} must be {' or '.join(kinds)}, got {type(value).__name__} "
                          f"{value!r} {where(keys)}")
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and isinstance(value, hint) and not (
            hint is int and isinstance(value, bool)):
        return value
    expected = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{name} must be {expected}, got {type(value).__name__} {value!r} "
                      f"{where(keys)}")


def _parse_override(raw: str) -> Any:
    """A `--set` value: TOML syntax when it parses, a bare string otherwise."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {part} is not a table")
        node = child
    node[last] = value
