"""Compressed pulls through a real daemon: a learner pushing with a codec pulls each new
version as a compressed delta (bytes on the wire: the codec's, not fp32's), and what it
rebuilds is, bit for bit, the reference another learner gets in fp32; the reference stays
close to the committed values that fp32 learners pull. A learner some versions behind gets
the deltas since, in one answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from learner.client import Retry, SynchronizerClient
from protos.codec import FP32, codec_named
from tests.daemon import Daemon

# Two int8 chunks and a part at the daemon's default chunk size (2 MiB).
NUMEL = 5 << 20
VERSIONS = 6


def client(daemon: Daemon, learner_id: str, codec: str, bulk: bool) -> SynchronizerClient:
    return SynchronizerClient(daemon.address, learner_id, "layout-delta", [NUMEL],
                              codec=codec, retry=Retry(give_up_after_s=20), bulk=bulk)


def sent(daemon: Daemon) -> int:
    return daemon.status().bytes_out


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
@pytest.mark.parametrize("codec", ["int8", "e3m0"])
def test_delta_pulls_rebuild_the_reference_bit_for_bit(
        start_daemon: Callable[..., Daemon], codec: str, bulk: bool) -> None:
    daemon = start_daemon("--set", "policy.grace_max_s=0")
    rng = np.random.default_rng(3)

    async def scenario() -> None:
        chained = client(daemon, "chained", codec, bulk)
        fresh = client(daemon, "fresh", codec, bulk)
        plain = client(daemon, "plain", "fp32", bulk)
        for c in (chained, fresh, plain):
            await c.join()
        assert await chained.push_initial(0, rng.standard_normal(NUMEL).astype(np.float32))
        for version in range(1, VERSIONS + 1):
            step = (0.01 * rng.standard_normal(NUMEL)).astype(np.float32)
            await chained.push(0, step, base_version=version - 1, c_tokens=100, c_steps=10,
                               local_step=10 * version)
            before = sent(daemon)
            pulled = await chained.pull(0, have_version=version - 1, wait_s=10)
            wire = sent(daemon) - before
            assert pulled is not None and pulled.version == version
            # The first pull holds no reference yet: fp32. Then deltas in the codec.
            expected = (FP32 if version == 1 else codec_named(codec)).encoded_bytes(NUMEL)
            assert wire == expected, (version, wire, expected)
            fresh.references.clear()  # holds nothing: gets the reference in fp32
            reference = await fresh.pull(0, have_version=version - 1, wait_s=10)
            assert reference is not None and reference.commit_id == pulled.commit_id
            np.testing.assert_array_equal(pulled.values.view(np.uint32),
                                          reference.values.view(np.uint32))
            committed = await plain.pull(0, have_version=version - 1, wait_s=10)
            assert committed is not None and committed.version == version
            # Error feedback: the reference is one compression step from the committed
            # values (the changes here are ~0.01 per element).
            assert float(np.max(np.abs(pulled.values - committed.values))) < 0.01
        # Two versions pass while the chained learner does not pull; a fresh learner's
        # pulls move the reference on at each. Then the two deltas come in one answer.
        for version in (VERSIONS + 1, VERSIONS + 2):
            step = (0.01 * rng.standard_normal(NUMEL)).astype(np.float32)
            await plain.push(0, step, base_version=version - 1, c_tokens=100, c_steps=10,
                             local_step=10 * version)
            fresh.references.clear()
            reference = await fresh.pull(0, have_version=version - 1, wait_s=10)
            assert reference is not None and reference.version == version
        before = sent(daemon)
        pulled = await chained.pull(0, have_version=VERSIONS, wait_s=10)
        assert pulled is not None and pulled.version == VERSIONS + 2
        assert sent(daemon) - before == 2 * codec_named(codec).encoded_bytes(NUMEL)
        assert reference is not None
        np.testing.assert_array_equal(pulled.values.view(np.uint32),
                                      reference.values.view(np.uint32))
        for c in (chained, fresh, plain):
            await c.close()

    asyncio.run(scenario())
