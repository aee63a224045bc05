"""Compressed pulls through a real daemon: a learner pushing with a codec pulls each new
version as a compressed delta (bytes on the wire: the codec's, not fp32's), and what it
rebuilds is, bit for bit, the reference another learner gets in fp32; the reference stays
close to the committed values that fp32 learners pull. A learner some versions behind gets
the deltas since, in one answer. A delta whose encoding fails while it streams cuts the
pull, and the learner's pull again gets the reference whole."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

from coordinator.config import CoordinatorConfig
from coordinator.engine import Engine
from coordinator.policy import PolicyConfig
from coordinator.service import SynchronizerService, status_of
from learner.client import Retry, SynchronizerClient
from protos import ftsync_pb2_grpc as pb_grpc
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


def test_a_delta_whose_encoding_fails_midway_is_cut_and_pulled_again_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon in this process, so that the int8 encoding can fail at its second
    chunk of an advance: the learner has the first chunk of the delta when its pull is
    cut. It pulls again, and gets the version whole, a reference it can take deltas
    from; the failure is counted as a cut pull."""
    int8 = type(codec_named("int8"))
    encode = int8.encode
    encoded = 0

    def failing_at_the_second_chunk(self: object, values: np.ndarray) -> tuple[bytes, float]:
        nonlocal encoded
        encoded += 1
        if encoded == 2:
            raise MemoryError("no memory for the chunk's encoding")
        return encode(self, values)  # type: ignore[arg-type]

    async def scenario() -> None:
        engine = Engine(CoordinatorConfig(state_dir=str(tmp_path / "state"), fsync=False,
                                          policy=PolicyConfig(grace_max_s=0)))
        await engine.start()
        server = grpc.aio.server()
        pb_grpc.add_SynchronizerServicer_to_server(SynchronizerService(engine), server)
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        plain = SynchronizerClient(address, "plain", "layout-delta", [NUMEL],
                                   retry=Retry(give_up_after_s=20))
        chained = SynchronizerClient(address, "chained", "layout-delta", [NUMEL],
                                     codec="int8", retry=Retry(give_up_after_s=20))
        try:
            for c in (plain, chained):
                await c.join()
            rng = np.random.default_rng(5)
            assert await plain.push_initial(0, rng.standard_normal(NUMEL).astype(np.float32))
            assert await chained.pull(0, have_version=-1, wait_s=10) is not None
            held = chained.references[0][1]
            step = (0.01 * rng.standard_normal(NUMEL)).astype(np.float32)
            await plain.push(0, step, base_version=0, c_tokens=100, c_steps=10, local_step=10)
            monkeypatch.setattr(int8, "encode", failing_at_the_second_chunk)
            pulled = await chained.pull(0, have_version=0, wait_s=10)
            assert encoded == 2  # the advance failed, and no other began
            committed = await plain.pull(0, have_version=0, wait_s=10)
            assert pulled is not None and committed is not None and pulled.version == 1
            # Whole: the committed values themselves, under a reference of their own.
            np.testing.assert_array_equal(pulled.values.view(np.uint32),
                                          committed.values.view(np.uint32))
            assert chained.references[0][1] not in (0, held)
            assert dict(status_of(engine).rejections) == {"cut": 1}
            # The next version comes as a delta again, from that reference.
            monkeypatch.setattr(int8, "encode", encode)
            await plain.push(0, step, base_version=1, c_tokens=100, c_steps=10, local_step=20)
            before = status_of(engine).bytes_out
            delta = await chained.pull(0, have_version=1, wait_s=10)
            assert delta is not None and delta.version == 2
            assert status_of(engine).bytes_out - before == codec_named("int8").encoded_bytes(NUMEL)
        finally:
            for c in (plain, chained):
                await c.close()
            await server.stop(None)
            await engine.stop()

    asyncio.run(scenario())
