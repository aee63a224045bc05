"""How long a learner's calls keep retrying (measured from the first failure, so a
long pull that fails late still gets its retries), and what a push that gave up keeps."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import numpy as np
import pytest

from learner.client import Retry, SynchronizerClient
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), "connection reset", None)


def client(give_up_after_s: float) -> SynchronizerClient:
    return SynchronizerClient("127.0.0.1:9", "l0", "layout", [4],
                              retry=Retry(initial_s=0.01, max_s=0.02,
                                          give_up_after_s=give_up_after_s))


def test_a_call_that_fails_after_a_long_wait_is_still_retried() -> None:
    attempts = 0

    async def long_pull() -> str:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            await asyncio.sleep(0.3)  # a long-poll, longer than the give-up time
            raise unavailable()
        return "pulled"

    assert asyncio.run(client(give_up_after_s=0.2)._retrying(long_pull)) == "pulled"
    assert attempts == 2


def test_a_call_failing_for_longer_than_the_give_up_time_raises() -> None:
    attempts = 0

    async def always_down() -> str:
        nonlocal attempts
        attempts += 1
        raise unavailable()

    # A second of 10-20 ms backoffs: dozens of attempts, and more than two however
    # little CPU a busy machine leaves this process.
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(client(give_up_after_s=1.0)._retrying(always_down))
    assert attempts > 2


class LeaderlessStandby(pb_grpc.SynchronizerServicer):  # type: ignore[misc]
    """A real gRPC server answering every push as a standby that knows no leader."""

    async def PushFragment(self, request_iterator: Any,
                           context: grpc.aio.ServicerContext[Any, Any]) -> pb.PushResponse:
        context.set_trailing_metadata((("ftsync-reason", "not_leader"),))
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            "not_leader: this replica is a standby and knows no leader")
        raise AssertionError("abort returned")


def test_a_push_nobody_led_to_take_stays_in_the_outbox() -> None:
    """Giving up on finding a leader is not a refusal of the contribution: it is
    pushed again once one leads, as after any coordinator outage."""

    async def scenario() -> SynchronizerClient:
        server = grpc.aio.server()
        pb_grpc.add_SynchronizerServicer_to_server(LeaderlessStandby(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            learner = SynchronizerClient(f"127.0.0.1:{port}", "l0", "layout", [4],
                                         retry=Retry(initial_s=0.01, max_s=0.02,
                                                     give_up_after_s=0.3))
            assert await learner.push(0, np.ones(4, np.float32), base_version=0,
                                      c_tokens=1, c_steps=1, local_step=1) is None
            await learner.close()
            return learner
        finally:
            await server.stop(None)

    learner = asyncio.run(scenario())
    assert len(learner.outbox) == 1 and learner.stats.dropped == {}
