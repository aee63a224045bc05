"""A real learner client talking gRPC to a real coordinator daemon through the
fault-injecting proxy, as the chaos harness wires them: traffic passes,
latency shows in call times, and the client rides out resets and partitions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest

from chaos.proxy import LinkSpec, TokenBucket
from learner.client import Retry, SynchronizerClient
from tests.daemon import Daemon, proxy_in_front

pytestmark = pytest.mark.timeout(60)

NUMELS = [3000, 1000]


async def timed_pull(client: SynchronizerClient) -> float:
    """Seconds to pull fragment 0, which is newer than version 0: no long-poll."""
    started = time.monotonic()
    pulled = await client.pull(0, have_version=0, wait_s=5.0)
    assert pulled is not None and pulled.version == 1
    return time.monotonic() - started


def test_learner_through_the_proxy_survives_latency_resets_and_partitions(
        start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon()
    with proxy_in_front(daemon) as proxy:

        async def scenario() -> None:
            client = SynchronizerClient(proxy.address, "a", "layout-a", NUMELS,
                                        retry=Retry(initial_s=0.05, max_s=0.5,
                                                    give_up_after_s=15))
            await client.join()
            for p, n in enumerate(NUMELS):
                assert await client.push_initial(p, np.ones(n, dtype=np.float32))
            await client.push(0, np.full(NUMELS[0], 0.1, dtype=np.float32), base_version=0,
                              c_tokens=100, c_steps=10, local_step=10)
            pulled = await client.pull(0, have_version=0, wait_s=5.0)
            assert pulled is not None and pulled.version == 1
            # The daemon's outer step, as in test_daemon: Θ = 1 − 0.7·0.1 (no momentum).
            np.testing.assert_allclose(pulled.values, 1 - 0.7 * 0.1, rtol=1e-6)
            described = proxy.describe()
            assert described["bytes_up"] > 4 * sum(NUMELS)
            assert described["bytes_down"] > 4 * NUMELS[0]

            baseline = min([await timed_pull(client) for _ in range(3)])
            proxy.set_latency(100)
            slowed = await timed_pull(client)
            # 100 ms each way: the request's trip and the reply's.
            assert slowed >= 0.2 and slowed >= baseline + 0.1, (baseline, slowed)
            proxy.set_latency(0)

            accepted = proxy.describe()["connections_accepted"]
            proxy.reset_connections()
            await client.heartbeat(local_step=11)
            assert proxy.describe()["connections_accepted"] > accepted

            proxy.partition()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.heartbeat(local_step=12), 1.0)
            assert proxy.describe()["bytes_discarded_up"] > 0
            proxy.heal()
            await client.heartbeat(local_step=13)
            assert await timed_pull(client) < 5.0  # through again: a cut pull waits 15 s
            await client.close()

        asyncio.run(scenario())
        assert proxy.describe()["connections_reset"] >= 2


def test_a_push_and_pull_over_a_wide_area_link_cost_at_least_its_bytes_and_round_trips(
        start_daemon: Callable[..., Daemon]) -> None:
    """The learner behind a proxy made a long thin link from the start: a push and
    the pull of its merge take at least the bytes at the link's rate plus their
    round trips, and the proxy carried no faster than the cap (give or take one
    burst of its bucket)."""
    daemon = start_daemon("--set", "fsync=false")
    numels = [250_000, 250_000]  # 1 MB of fp32 each way
    latency_ms, rate = 30.0, 4_000_000.0
    with proxy_in_front(daemon, link=LinkSpec(latency_ms, rate)) as proxy:

        async def scenario() -> None:
            client = SynchronizerClient(proxy.address, "wan", "layout-wan", numels,
                                        codec="int8")
            await client.join()
            for p, n in enumerate(numels):
                assert await client.push_initial(p, np.ones(n, dtype=np.float32))
            before = proxy.describe()
            started = time.monotonic()
            targets = await asyncio.gather(*(
                client.push(p, np.full(n, 0.1, dtype=np.float32), base_version=0,
                            c_tokens=100, c_steps=10, local_step=10)
                for p, n in enumerate(numels)))
            pushed = time.monotonic()
            pulls = await asyncio.gather(*(client.pull(p, 0, 10.0) for p in range(2)))
            elapsed = time.monotonic() - started
            assert targets == [1, 1] and all(p is not None and p.version == 1 for p in pulls)
            after = proxy.describe()
            up = after["bytes_up"] - before["bytes_up"]
            down = after["bytes_down"] - before["bytes_down"]
            # int8 pushes a byte a parameter; pulls come back as fp32.
            assert sum(numels) <= up < 1.1 * sum(numels) and down >= 4 * sum(numels)
            rtt = 2 * latency_ms / 1000
            burst = TokenBucket(rate).burst
            assert pushed - started >= (up - burst) / rate + rtt
            assert elapsed >= (up - burst) / rate + (down - burst) / rate + 2 * rtt
            assert (down - burst) / (elapsed - (pushed - started)) <= 1.1 * rate
            await client.close()

        asyncio.run(scenario())
