"""The standard `grpc.health.v1.Health` service of a coordinator, for probes.

Docker and Kubernetes probes, load balancers and `ftsync-coordinator health`
ask it whether learners should be sent here. A replica is SERVING while it
can commit: it leads, its lease holds, it has resumed its run's state, and it
is neither draining nor stopped by a failure (`Engine.serving`); a standby, a
draining replica and one still resuming are NOT_SERVING. The server as a
whole ("") and `ftsync.v1.Synchronizer` report the same status. A lease runs
out with the clock rather than with an event, so `follow` looks at the
engine every `poll_s`; the daemon runs it beside the server.
"""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2

from coordinator.engine import Engine
from protos import ftsync_pb2 as pb

# The names a probe may ask about: the whole server, and the learners' service.
SERVICES = ("", pb.DESCRIPTOR.services_by_name["Synchronizer"].full_name)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """The health servicer, kept in step with one engine."""

    def __init__(self, engine: Engine, poll_s: float = 0.05) -> None:
        self.engine = engine
        self.poll_s = poll_s
        # The reference asyncio servicer (Check and Watch); exported under a version check
        # that mypy cannot follow.
        self.servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._status: int | None = None

    async def update(self) -> None:
        """Publish the engine's status now, if it changed."""
        status = SERVING if self.engine.serving else NOT_SERVING
        if status != self._status:
            self._status = status
            for service in SERVICES:
                await self.servicer.set(service, status)

    async def follow(self) -> None:
        """Update for ever (cancel to stop)."""
        while True:
            await self.update()
            await asyncio.sleep(self.poll_s)

    async def stop(self) -> None:
        """NOT_SERVING for good: the server is shutting down."""
        await self.servicer.enter_graceful_shutdown()
