"""Merge benchmark: how fast the synchronizer folds contributions in, how long a commit
takes, and how much memory the daemon holds as pushers pile into one round.

(a) Ingest: fp32 outer-gradient bytes folded into the open round per second, through
    `Engine.push` in this process (no network): chunk decode into a staging buffer, the
    per-chunk norm, validation, weighting and accumulation, exactly the daemon's code. The
    chunk messages are built beforehand; a second figure parses them from their wire bytes
    first, as gRPC does in the daemon. The baseline is `np.copyto` of a same-sized float32
    array, measured in the same run; the ratio is ingest / copy.
(b) Commit: merge, outer step and durable write (fsync on) of the whole N-parameter
    fragment set, from the moment every fragment's round is due to its version being
    published: the `Engine._close` calls the round timer makes. Also without fsync, and
    the merge + outer step and the checksum alone (xxh3, and zlib's crc32 it replaced), to
    show where the time goes.
(c) Memory: peak RSS of a real daemon process (sampled every 20 ms with psutil, and the
    kernel's high-water mark) while 1, 4 and 16 learners push one contribution for every
    fragment into the same round (`--min-quorum K` keeps it open until all arrived).

Run from the repository root: `python -m bench.merge [--params N] [--fragments P]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import xxhash

from bench.transfer import (
    FP32,
    LAYOUT_HASH,
    MB,
    BenchLearner,
    Floats,
    WireCount,
    base_parser,
    emit,
    fragment_sizes,
    log,
    make_layout,
    make_model,
    push_messages,
    split,
)
from chaos.local import CoordinatorProcess as Daemon
from coordinator.config import CoordinatorConfig, OuterConfig
from coordinator.engine import Engine
from coordinator.merge import Accumulator, norm_sq, outer_step
from protos import ftsync_pb2 as pb
from protos.codec import decode_chunk_into

LEARNER = "bench-learner"
PUSHERS = (1, 4, 16)
# The weight every contribution gets (c_tokens²/c_steps with the bench's headers).
C_TOKENS, C_STEPS = 4096, 16


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def copy_bandwidth(values: Floats, repeats: int = 5) -> float:
    """Bytes per second `np.copyto` moves between two warm float32 arrays (best of a few)."""
    target = np.empty_like(values)
    np.copyto(target, values)
    return values.nbytes / best_seconds(lambda: np.copyto(target, values), repeats)


def chunk_messages(values: Floats, chunk_bytes: int) -> list[pb.PushMessage]:
    """The chunk messages of one fp32 push, as the daemon receives them (header dropped)."""
    header = pb.PushHeader()
    return list(push_messages(header, values, FP32, chunk_bytes, WireCount()))[1:]


async def feed(messages: Sequence[pb.PushMessage]) -> AsyncIterator[pb.PushMessage]:
    for message in messages:
        yield message


async def feed_parsed(wire: Sequence[bytes]) -> AsyncIterator[pb.PushMessage]:
    for data in wire:
        yield pb.PushMessage.FromString(data)


class InProcessLearner:
    """Drives an `Engine` directly, as the gRPC shell would for one learner."""

    def __init__(self, engine: Engine, sizes: Sequence[int]) -> None:
        self.engine = engine
        self.sizes = list(sizes)
        result = engine.join(pb.JoinRequest(learner_id=LEARNER, layout=make_layout(sizes)))
        self.next_seq = result.next_seq

    def header(self, fragment: int, base_version: int, init: bool = False) -> pb.PushHeader:
        seq = self.next_seq
        self.next_seq += 1
        return pb.PushHeader(learner_id=LEARNER, fragment=fragment, layout_hash=LAYOUT_HASH,
                             seq=seq, base_version=base_version, c_tokens=C_TOKENS,
                             c_steps=C_STEPS, codec=FP32.wire, numel=self.sizes[fragment],
                             init=init)

    async def push_all(self, messages: list[list[pb.PushMessage]], base_version: int,
                       init: bool = False) -> float:
        """Push one contribution (or initial value) per fragment, in turn; returns seconds."""
        started = time.perf_counter()
        for p, chunks in enumerate(messages):
            await self.engine.push(self.header(p, base_version, init), feed(chunks))
        return time.perf_counter() - started

    async def push_all_parsed(self, wire: list[list[bytes]], base_version: int) -> float:
        started = time.perf_counter()
        for p, chunks in enumerate(wire):
            await self.engine.push(self.header(p, base_version), feed_parsed(chunks))
        return time.perf_counter() - started


# -- (a) ingest ------------------------------------------------------------------------------

def ingest_breakdown(sizes: Sequence[int], messages: list[list[pb.PushMessage]],
                     repeats: int) -> dict[str, float]:
    """The ingest steps alone, over the same chunks: where the time goes. Decode and
    norm as two passes per chunk, and fused (`decode_norm_into`, what the daemon runs);
    the same two steps and the fold in torch, the alternative to numpy's `out=`."""
    largest = max(sizes)
    staging = np.empty(largest, dtype=np.float32)
    accumulator = Accumulator("mean")
    accumulator.fold(np.zeros(largest, dtype=np.float32), 1.0, 0.0)

    def decode() -> None:
        for chunks in messages:
            for message in chunks:
                decode_chunk_into(message.chunk, FP32, staging)

    def norm() -> None:
        for chunks in messages:
            for message in chunks:
                chunk = message.chunk
                norm_sq(staging[chunk.offset:chunk.offset + chunk.count])

    def decode_then_norm() -> None:
        for chunks in messages:
            for message in chunks:
                chunk = message.chunk
                part = staging[chunk.offset:chunk.offset + chunk.count]
                FP32.decode_into(chunk.data, chunk.scale, part, 0.5)
                norm_sq(part)

    def decode_norm() -> None:
        for chunks in messages:
            for message in chunks:
                chunk = message.chunk
                FP32.decode_norm_into(chunk.data, chunk.scale,
                                      staging[chunk.offset:chunk.offset + chunk.count], 0.5)

    def fold() -> None:
        for n in sizes:
            accumulator.fold(staging[:n], 1.0, 0.0)

    import torch

    torch.set_num_threads(1)  # the daemon's numpy work runs on one worker thread at a time
    # Read only, as the chunk's bytes are: torch says so once per buffer.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    tensor, total = torch.from_numpy(staging), torch.from_numpy(accumulator.sum)

    def torch_decode_norm() -> None:
        for chunks in messages:
            for message in chunks:
                chunk = message.chunk
                part = tensor[chunk.offset:chunk.offset + chunk.count]
                torch.mul(torch.frombuffer(chunk.data, dtype=torch.float32), 0.5, out=part)
                float(torch.dot(part, part))

    def torch_fold() -> None:
        for n in sizes:
            total[:n].add_(tensor[:n], alpha=0.5)  # the weight in the same pass

    return {"decode_s": best_seconds(decode, repeats), "norm_s": best_seconds(norm, repeats),
            "fold_s": best_seconds(fold, repeats),
            "decode_then_norm_s": best_seconds(decode_then_norm, repeats),
            "decode_norm_fused_s": best_seconds(decode_norm, repeats),
            "torch_decode_norm_s": best_seconds(torch_decode_norm, repeats),
            "torch_fold_weighted_s": best_seconds(torch_fold, repeats)}


async def measure_ingest(sizes: list[int], delta: Floats, chunk_bytes: int, repeats: int,
                         ) -> dict[str, Any]:
    deltas = split(delta, sizes)
    messages = [chunk_messages(d, chunk_bytes) for d in deltas]
    wire = [[m.SerializeToString() for m in chunks] for chunks in messages]
    with tempfile.TemporaryDirectory(prefix="ftsync-bench-ingest-") as tmp:
        # Never started: no round timer, so the round stays open and every push folds into
        # the same accumulator, as contributions from many learners would.
        engine = Engine(CoordinatorConfig(state_dir=tmp, fsync=False))
        learner = InProcessLearner(engine, sizes)
        await learner.push_all(messages, 0, init=True)
        # Warm-up: the first contribution becomes the accumulator, the second takes the
        # add path and leaves a staging buffer in the pool.
        await learner.push_all(messages, 0)
        await learner.push_all(messages, 0)
        runs = [await learner.push_all(messages, 0) for _ in range(repeats)]
        parsed = [await learner.push_all_parsed(wire, 0) for _ in range(repeats)]
        store = engine.store
        assert store is not None
        merged = store.stats(0)[1]
        await engine.stop()
    if merged != 2 + 2 * repeats:
        raise RuntimeError(f"expected {2 + 2 * repeats} contributions folded, got {merged}")
    breakdown = ingest_breakdown(sizes, messages, repeats)
    best, best_parsed = min(runs), min(parsed)
    return {"bytes_per_s": delta.nbytes / best, "seconds": best,
            "runs_s": [round(r, 4) for r in runs],
            "with_parse_bytes_per_s": delta.nbytes / best_parsed,
            "with_parse_runs_s": [round(r, 4) for r in parsed],
            "breakdown_s": breakdown}


# -- (b) commit ---------------------------------------------------------------------------------

async def commit_round(engine: Engine, learner: InProcessLearner,
                       messages: list[list[pb.PushMessage]], version: int) -> dict[str, Any]:
    """One contribution per fragment against `version`, then close every round in turn."""
    push_s = await learner.push_all(messages, version)
    per_fragment = []
    for p in range(len(messages)):
        started = time.perf_counter()
        await engine._close(engine._policy(), engine._store(), p)
        per_fragment.append(time.perf_counter() - started)
    store = engine.store
    assert store is not None
    for p in range(len(messages)):
        published = store.published(p)
        if published is None or published.version != version + 1:
            raise RuntimeError(f"fragment {p} did not publish version {version + 1}")
    return {"seconds": sum(per_fragment), "per_fragment_s": [round(s, 4) for s in per_fragment],
            "push_s": push_s}


def commit_breakdown(sizes: Sequence[int], delta: Floats, repeats: int) -> dict[str, float]:
    """Merge + outer step and the checksum alone, on arrays of the fragments' sizes."""
    outer = OuterConfig()
    largest = max(sizes)
    params = np.ones(largest, dtype=np.float32)
    momentum = np.zeros(largest, dtype=np.float32)
    buffer = np.empty(largest, dtype=np.float32)

    def merge_and_step() -> float:
        """Seconds of `Accumulator.result` + `outer_step` over every fragment."""
        seconds = 0.0
        offset = 0
        for n in sizes:
            np.copyto(buffer[:n], delta[offset:offset + n])
            accumulator = Accumulator("mean")
            accumulator.fold(buffer[:n], 1.0, 0.0)
            started = time.perf_counter()
            outer_step(outer, params[:n], momentum[:n], accumulator.result(1.0))
            seconds += time.perf_counter() - started
            offset += n
        return seconds

    def checksum() -> None:
        """The durable file's checksum of every fragment's params + momentum."""
        for n in sizes:
            digest = xxhash.xxh3_64(params[:n].data.cast("B"))
            digest.update(momentum[:n].data.cast("B"))
            digest.intdigest()

    def crc32() -> None:
        """The same bytes through zlib's crc32, the checksum before xxh3."""
        for n in sizes:
            zlib.crc32(momentum[:n].data.cast("B"), zlib.crc32(params[:n].data.cast("B")))

    return {"merge_outer_step_s": min(merge_and_step() for _ in range(repeats)),
            "checksum_xxh3_s": best_seconds(checksum, repeats),
            "crc32_s": best_seconds(crc32, repeats)}


async def measure_commit(sizes: list[int], theta: Floats, delta: Floats, chunk_bytes: int,
                         state_root: Path) -> dict[str, Any]:
    thetas = [chunk_messages(t, chunk_bytes) for t in split(theta, sizes)]
    messages = [chunk_messages(d, chunk_bytes) for d in split(delta, sizes)]
    engine = Engine(CoordinatorConfig(state_dir=str(state_root / "commit"), fsync=True))
    learner = InProcessLearner(engine, sizes)
    init_s = await learner.push_all(thetas, 0, init=True)
    del thetas
    synced = [await commit_round(engine, learner, messages, v) for v in (0, 1)]
    engine.state.fsync = False
    unsynced = await commit_round(engine, learner, messages, 2)
    store = engine.store
    assert store is not None
    written = store.bytes_written
    await engine.stop()
    best = min(synced, key=lambda r: r["seconds"])
    return {"seconds": best["seconds"], "per_fragment_s": best["per_fragment_s"],
            "runs_s": [round(r["seconds"], 4) for r in synced],
            "no_fsync_s": unsynced["seconds"], "init_push_and_write_s": init_s,
            # Every push here is the first of its round, so its staging buffer is fresh.
            "first_in_round_ingest_bytes_per_s": delta.nbytes / min(
                r["push_s"] for r in (*synced, unsynced)),
            # The initial values and three versions, each params + momentum + header.
            "bytes_written_per_version": written // 4}


# -- (c) memory -------------------------------------------------------------------------------

class RssSampler(threading.Thread):
    """Samples a process's RSS every `interval` seconds until stopped."""

    def __init__(self, pid: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.process = psutil.Process(pid)
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._halt = threading.Event()

    def current(self) -> int:
        return int(self.process.memory_info().rss)

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                rss = self.current()
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            self.samples += 1
            self._halt.wait(self.interval)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak


def high_water_mark(pid: int) -> int:
    """The kernel's peak RSS of a process (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


async def pushers_round(address: str, sizes: list[int], thetas: list[Floats],
                        deltas: list[Floats], pushers: int, chunk_bytes: int,
                        sampler: RssSampler) -> dict[str, Any]:
    learners = [BenchLearner(address, f"pusher-{i}", sizes, chunk_bytes)
                for i in range(pushers)]
    try:
        for learner in learners:
            await learner.join()
        for p, values in enumerate(thetas):
            await learners[0].push(p, values, init=True)
        after_init = sampler.current()
        peak_before = sampler.peak

        async def push_every_fragment(learner: BenchLearner) -> None:
            for p, values in enumerate(deltas):
                await learner.push(p, values, base_version=0)

        started = time.perf_counter()
        await asyncio.gather(*(push_every_fragment(learner) for learner in learners))
        acked = time.perf_counter()
        await learners[0].wait_versions(1)
        published = time.perf_counter()
        return {"rss_after_init": after_init, "peak_rss_before_round": peak_before,
                "push_s": acked - started, "round_s": published - started,
                # The last fragment's merge + outer step + write (fsync off), plus polling.
                "last_ack_to_published_s": published - acked}
    finally:
        for learner in learners:
            await learner.close()


def measure_memory(sizes: list[int], theta: Floats, delta: Floats, chunk_bytes: int,
                   state_root: Path) -> dict[str, Any]:
    thetas, deltas = split(theta, sizes), split(delta, sizes)
    model = theta.nbytes
    results: dict[str, Any] = {}
    for pushers in PUSHERS:
        daemon = Daemon(state_dir=state_root / f"rss{pushers}",
                        args=["--min-quorum", str(pushers), "--set", "fsync=false"]).start()
        try:
            assert daemon.process is not None
            pid = daemon.process.pid
            sampler = RssSampler(pid)
            sampler.start()
            try:
                round_result = asyncio.run(pushers_round(
                    daemon.address, sizes, thetas, deltas, pushers, chunk_bytes, sampler))
            finally:
                sampled = sampler.stop()
            hwm = high_water_mark(pid)
        finally:
            daemon.stop()
        peak = max(hwm, sampled)
        results[str(pushers)] = {
            "peak_rss_bytes": peak, "peak_rss_sampled_bytes": sampled, "vm_hwm_bytes": hwm,
            "peak_model_multiple": peak / model, "samples": sampler.samples, **round_result,
            "rss_after_init_model_multiple": round_result["rss_after_init"] / model,
            "push_mb_s": pushers * model / round_result["push_s"] / MB}
        log(f"  {pushers:>2} pushers: peak RSS {peak / 2**30:.2f} GiB "
            f"({peak / model:.2f}x model), after init {round_result['rss_after_init'] / 2**30:.2f}"
            f" GiB, round {round_result['round_s']:.1f} s")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "merge benchmark")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed repetitions of each ingest measure; the best counts")
    parser.add_argument("--skip-memory", action="store_true",
                        help="leave out (c), the daemon's peak RSS with 1/4/16 pushers")
    args = parser.parse_args(argv)
    sizes = fragment_sizes(args.params, args.fragments)
    load_before = os.getloadavg()
    log(f"{args.params:,} fp32 parameters in {args.fragments} fragments "
        f"({4 * args.params / MB:.0f} MB); load average {load_before[0]:.2f}")
    theta, delta = make_model(args.params)

    log("(a) ingest through Engine.push, and numpy copy bandwidth")
    copy_before = copy_bandwidth(delta)
    ingest = asyncio.run(measure_ingest(sizes, delta, args.chunk_bytes, args.repeats))
    copy = max(copy_before, copy_bandwidth(delta))
    log(f"  ingest {ingest['bytes_per_s'] / MB:.0f} MB/s "
        f"(parsing included {ingest['with_parse_bytes_per_s'] / MB:.0f} MB/s), "
        f"copy {copy / MB:.0f} MB/s")

    with tempfile.TemporaryDirectory(prefix="ftsync-bench-merge-") as tmp:
        root = Path(tmp)
        log("(b) commit: merge + outer step + durable write, fsync on")
        commit = asyncio.run(measure_commit(sizes, theta, delta, args.chunk_bytes, root))
        commit["breakdown_s"] = commit_breakdown(sizes, delta, args.repeats)
        log(f"  {commit['seconds']:.2f} s (without fsync {commit['no_fsync_s']:.2f} s)")
        memory: dict[str, Any] = {}
        if not args.skip_memory:
            log("(c) daemon peak RSS with 1, 4 and 16 concurrent pushers")
            memory = measure_memory(sizes, theta, delta, args.chunk_bytes, root)

    result: dict[str, Any] = {
        "name": "merge",
        "ratio": ingest["bytes_per_s"] / copy,
        "target": 0.3,
        "unit": "fraction of numpy copy bandwidth",
        "params": args.params,
        "fragments": args.fragments,
        "chunk_bytes": args.chunk_bytes,
        "mb": "1e6 bytes",
        "model_bytes": theta.nbytes,
        "ingest_mb_s": ingest["bytes_per_s"] / MB,
        "copy_mb_s": copy / MB,
        "ingest_with_parse_mb_s": ingest["with_parse_bytes_per_s"] / MB,
        "ingest_with_parse_ratio": ingest["with_parse_bytes_per_s"] / copy,
        "ingest_first_in_round_mb_s": commit["first_in_round_ingest_bytes_per_s"] / MB,
        "ingest": ingest,
        "commit_s": commit["seconds"],
        "commit": commit,
    }
    if memory:
        result["rss"] = memory
        result["rss_growth_1_to_16"] = (memory["16"]["peak_rss_bytes"]
                                        / memory["1"]["peak_rss_bytes"])
        result["rss_per_extra_pusher_4_to_16_bytes"] = (
            memory["16"]["peak_rss_bytes"] - memory["4"]["peak_rss_bytes"]) / 12
    result["load_average"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    emit(result)


if __name__ == "__main__":
    main()
