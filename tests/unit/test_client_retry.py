"""How long a learner's calls keep retrying: measured from the first failure, so a
long pull that fails late still gets its retries."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from learner.client import Retry, SynchronizerClient


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

    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(client(give_up_after_s=0.2)._retrying(always_down))
    assert attempts > 2
