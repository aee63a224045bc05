"""The coordinator's etcd client: the few calls high availability needs, typed.

Everything the coordinator says to etcd goes through `Etcd`, a thin layer
over the `aetcd` asyncio client: leases (grant, keep alive, revoke), reads,
writes, the two transactions the election and the replicator rely on
(create a key only while it is absent, write a key only while a guard key
still has a given create revision) and waiting for a key or prefix to
change. Every call has its own deadline, so a stalled etcd turns into an
`EtcdError` in bounded time rather than a hung task; callers decide what a
failure means (a leader that cannot renew steps down). Several endpoints
given as IPv4 addresses share one gRPC channel that fails over between
them; named hosts are tried one at a time, moving on after a failure. Key
layout: `protos.discovery`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd
import aetcd.utils
import grpc
from aetcd import rpc

from protos import etcd_tls
from protos.tls import TlsMaterial

T = TypeVar("T")

# Default deadline of one etcd call.
CALL_TIMEOUT_S = 2.0


class EtcdError(RuntimeError):
    """etcd could not be reached, or did not answer in time."""


@dataclass(frozen=True)
class Entry:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def channel_targets(endpoints: Sequence[str]) -> list[tuple[str, int]]:
    """(host, port) pairs for aetcd, which dials `f"{host}:{port}"`.

    A plain target names one address, but gRPC's `ipv4:` scheme takes a list:
    IPv4 endpoints become the one target `ipv4:A:1,B:2,...`, whose pick-first
    policy moves to the next member when the connected one dies. Named hosts
    stay one target each."""
    if not endpoints:
        raise ValueError("no etcd endpoint given")
    pairs = [(host, int(port)) for host, _, port in (e.rpartition(":") for e in endpoints)]
    if len(pairs) == 1 or not all(_is_ipv4(host) for host, _ in pairs):
        return pairs
    listed = ",".join([*endpoints[:-1], pairs[-1][0]])
    return [(f"ipv4:{listed}", pairs[-1][1])]


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


class Etcd:
    """One connection to an etcd cluster."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = CALL_TIMEOUT_S,
                 material: TlsMaterial | None = None) -> None:
        self.endpoints = list(endpoints)
        self.material = material
        self.timeout_s = timeout_s
        self._targets = channel_targets(endpoints)
        self._target = 0
        self._client = self._connect()

    def _connect(self) -> aetcd.Client:
        host, port = self._targets[self._target]
        return etcd_tls.client(host, port, self.material, options={
            # Notice a dead member quickly and move to the next one.
            "grpc.keepalive_time_ms": 2_000,
            "grpc.keepalive_timeout_ms": 1_000,
            "grpc.keepalive_permit_without_calls": 1,
            "grpc.initial_reconnect_backoff_ms": 100,
            "grpc.max_reconnect_backoff_ms": 1_000,
        })

    def _next_target(self) -> None:
        if len(self._targets) == 1:
            return
        old = self._client
        self._target = (self._target + 1) % len(self._targets)
        self._client = self._connect()
        asyncio.get_running_loop().create_task(self._close(old))

    async def close(self) -> None:
        await self._close(self._client)

    async def _close(self, client: aetcd.Client) -> None:
        with contextlib.suppress(TimeoutError, aetcd.ClientError, grpc.RpcError):
            await asyncio.wait_for(client.close(), self.timeout_s)

    # -- leases ------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        lease = await self._call(self._client.lease(ttl_s))
        lease_id: int = lease.id
        return lease_id

    async def keepalive(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Renew a lease; its remaining TTL in seconds, 0 if it has expired."""
        reply = await self._call(self._client.refresh_lease(lease_id), timeout_s)
        return int(reply.TTL) if reply is not None else 0

    async def revoke(self, lease_id: int, timeout_s: float | None = None) -> None:
        await self._call(self._client.revoke_lease(lease_id), timeout_s)

    # -- keys --------------------------------------------------------------------------

    async def get(self, key: bytes) -> Entry | None:
        got = await self._call(self._client.get(key))
        return None if got is None else _entry(got)

    async def read(self, key: bytes) -> tuple[Entry | None, int]:
        """The key (None if absent) and the store revision it was read at."""
        got = await self._call(self._client.get_range(key, key + b"\0"))
        entries = [_entry(kv) for kv in got]
        return (entries[0] if entries else None), int(got.header.revision)

    async def get_prefix(self, prefix: bytes) -> tuple[list[Entry], int]:
        """Every key under `prefix` and the store revision they were read at."""
        got = await self._call(self._client.get_prefix(prefix))
        return [_entry(kv) for kv in got], int(got.header.revision)

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        await self._call(self._client.put(key, value, lease=lease or None))

    async def delete(self, key: bytes) -> None:
        await self._call(self._client.delete(key))

    async def create(self, key: bytes, value: bytes, lease: int = 0) -> tuple[bool, Entry | None]:
        """Put `key` only if it does not exist. (True, the new entry) if this call
        created it, (False, the existing entry or None if it vanished meanwhile)."""
        tx = self._client.transactions
        ok, responses = await self._call(self._client.transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, value, lease=lease or None)],
            failure=[tx.get(key)]))
        if ok:
            revision = int(responses[0].response_put.header.revision)
            return True, Entry(key, value, revision, revision, lease)
        found = responses[0] if responses else []
        return False, (_entry(found[0][1]) if found else None)

    async def put_fenced(self, key: bytes, value: bytes, guard: bytes, create_revision: int,
                         lease: int = 0) -> bool:
        """Put `key` only while `guard` exists with `create_revision` (the writer
        still holds what it was given at that revision); whether it was written."""
        tx = self._client.transactions
        ok, _ = await self._call(self._client.transaction(
            compare=[tx.create(guard) == create_revision],
            success=[tx.put(key, value, lease=lease or None)], failure=[]))
        return bool(ok)

    async def wait_change(self, key: bytes, after_revision: int, timeout_s: float,
                          prefix: bool = False) -> bool:
        """Wait until `key` (or any key under it) changes after `after_revision`;
        False when `timeout_s` passed first.

        One short Watch stream per wait, on aetcd's channel but not its shared
        watcher, whose clean-up can hang when a wait is cancelled."""
        await self._call(self._client.connect())
        create = rpc.WatchCreateRequest(key=key, start_revision=after_revision + 1)
        if prefix:
            create.range_end = aetcd.utils.prefix_range_end(key)
        done = asyncio.Event()

        async def requests() -> AsyncIterator[Any]:
            yield rpc.WatchRequest(create_request=create)
            await done.wait()  # etcd ends a watch stream the client half-closes

        call = rpc.WatchStub(self._client.channel).Watch(requests())
        try:
            # asyncio.timeout, not wait_for: no inner task whose cancellation would
            # wait on the request stream, which only ends in `finally`.
            async with asyncio.timeout(timeout_s):
                async for response in call:
                    if response.events or response.canceled or response.compact_revision:
                        break
            return True  # an event, or the stream ended: look again either way
        except TimeoutError:
            return False
        except grpc.aio.AioRpcError as exc:
            self._next_target()
            raise EtcdError(f"watching {key.decode(errors='replace')}: "
                            f"{exc.code().name} {exc.details()}") from exc
        finally:
            done.set()
            call.cancel()

    async def _call(self, call: Awaitable[T], timeout_s: float | None = None) -> T:
        try:
            async with asyncio.timeout(timeout_s or self.timeout_s):
                return await call
        except TimeoutError as exc:
            self._next_target()
            raise EtcdError(f"etcd at {','.join(self.endpoints)} did not answer in "
                            f"{timeout_s or self.timeout_s:.1f}s") from exc
        except (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError) as exc:
            self._next_target()
            raise EtcdError(f"etcd at {','.join(self.endpoints)}: {exc}") from exc
        except (aetcd.ClientError, grpc.RpcError) as exc:
            raise EtcdError(f"etcd at {','.join(self.endpoints)}: {exc}") from exc


def _entry(kv: Any) -> Entry:
    return Entry(bytes(kv.key), bytes(kv.value), int(kv.create_revision),
                 int(kv.mod_revision), int(kv.lease))
