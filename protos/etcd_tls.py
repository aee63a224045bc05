"""etcd clients over TLS, for the coordinator's replicas and for learners that
find the leader in etcd.

`aetcd` dials etcd in plaintext only. `client` returns its ordinary client
without TLS material and, with it, a subclass whose connection is a gRPC
channel secured with our certificate, key and CA (etcd's own client TLS:
`--cert-file`, `--trusted-ca-file` and `--client-cert-auth` on the server).
Only the connection differs; every call is aetcd's.
"""

from __future__ import annotations

from typing import Any

import aetcd
from aetcd import rpc, watcher

from protos import tls


class _TlsClient(aetcd.Client):  # type: ignore[misc]
    def __init__(self, material: tls.TlsMaterial, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._material = material

    async def connect(self) -> None:
        """aetcd's connect, minus user/password auth (certificates replace it), on a
        secure channel. Nothing here awaits, so no second caller can interleave."""
        if self._connected.is_set():
            return
        self.channel = tls.aio_channel(f"{self._host}:{self._port}", self._material,
                                       list(self._options.items()))
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                        metadata=self.metadata)
        self._connected.set()


def client(host: str, port: int, material: tls.TlsMaterial | None, *,
           timeout: int | None = None, options: dict[str, Any] | None = None) -> aetcd.Client:
    """An etcd client for `host:port`, over TLS when there is material."""
    if material is None:
        return aetcd.Client(host=host, port=port, timeout=timeout, options=options)
    return _TlsClient(material, host=host, port=port, timeout=timeout, options=options)
