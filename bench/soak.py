"""Soak benchmark: a long run's worth of commits, compressed into minutes.

A real `python -m coordinator` process (`fsync=false`, quorum 1, no grace
window, so every push commits at once) and one real gRPC learner client
(`learner.client.SynchronizerClient`) per fragment, in this process, pushing
tiny outer gradients as fast as they are acknowledged and heartbeating once
a second, until the fragments' versions add up to `--commits`. Every
`--sample-s` the daemon's RSS, its open file descriptors and the state
directory's size are sampled, with the commits so far.

At each checkpoint (`--checkpoints`, 1k, 10k and 100k commits by default)
the learners stop, the open rounds close, and the daemon is SIGKILLed as in
a crash. Then, on its state directory:

- resume time: `Engine.start()` in this process (run record, every
  fragment file, the manifest log), median of `--resume-repeats` after the
  first (which mends what the crash left, reported apart);
- the baseline, what resume cost when it read the whole manifest log:
  `read_manifests` of everything the directory holds (the audit trail);
- restart time: a new daemon process, from spawn until it answers Status,
  which must show every fragment at the version it had before the kill.

The learners then carry on against the restarted daemon (they join again
and push again what it lost, as after any crash). At the end the audit trail
is checked: per fragment, contiguous versions up to the last, no
contribution id merged twice.

ratio = resume_growth = resume time at the last checkpoint / at the first
(target <= 1.5, flat). RSS and descriptors are judged over the last daemon
life (from the last restart but one to the end) by their least-squares slope
per 10k commits after its first 10%.

Run from the repository root: `python -m bench.soak [--commits 100000]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from bench.transfer import emit, log
from chaos.local import CoordinatorProcess as Daemon
from coordinator.config import CoordinatorConfig
from coordinator.durability import KEEP_SEGMENTS, SEGMENT_BYTES, read_manifests
from coordinator.engine import Engine
from learner.client import Refused, SynchronizerClient
from protos import ftsync_pb2 as pb
from protos import ftsync_pb2_grpc as pb_grpc

RESUME_GROWTH_TARGET = 1.5
LAYOUT_HASH = "bench-soak"
PAGE = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- the daemon process, from outside ------------------------------------------------

@dataclass(frozen=True)
class ProcessSample:
    rss_bytes: int
    fds: int
    cpu_s: float  # user + system time so far


def sample_process(pid: int) -> ProcessSample:
    """RSS, open descriptors and CPU time of a running process, from /proc."""
    with open(f"/proc/{pid}/statm") as statm:
        rss_pages = int(statm.read().split()[1])
    with open(f"/proc/{pid}/stat") as stat:
        # Fields after the command name, which may hold spaces, in parentheses.
        fields = stat.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return ProcessSample(rss_pages * PAGE, len(os.listdir(f"/proc/{pid}/fd")),
                         (utime + stime) / CLOCK_TICKS)


def directory_bytes(root: Path) -> int:
    """Bytes of the regular files under `root` (files vanishing meanwhile skipped)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def daemon_pid(daemon: Daemon) -> int:
    assert daemon.process is not None
    return daemon.process.pid


def slope_per(xs: Sequence[float], ys: Sequence[float], per: float) -> float:
    """Least-squares slope of ys over xs, per `per` units of x (0 with too few points)."""
    if len(xs) < 3 or max(xs) == min(xs):
        return 0.0
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0]) * per


# -- the learners ---------------------------------------------------------------------

@dataclass
class Fleet:
    """One learner client per fragment, each pushing its own fragment."""

    address: str
    numel: int
    fragments: int
    clients: list[SynchronizerClient] = field(default_factory=list)
    pushes: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    async def join(self) -> None:
        numels = [self.numel] * self.fragments
        self.clients = [SynchronizerClient(self.address, f"soak{p}", LAYOUT_HASH, numels)
                        for p in range(self.fragments)]
        for p, client in enumerate(self.clients):
            await client.join()
            await client.push_initial(p, np.zeros(self.numel, dtype=np.float32))

    async def run(self, until: int, commits: CommitCounter) -> None:
        """Push until the fragments' versions add up to `until`."""
        stop = asyncio.Event()
        tasks = [asyncio.create_task(self._push(p, c, stop))
                 for p, c in enumerate(self.clients)]
        tasks += [asyncio.create_task(self._heartbeat(c, stop)) for c in self.clients]
        try:
            while await commits.read() < until:
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await asyncio.gather(*tasks)

    async def _push(self, fragment: int, client: SynchronizerClient,
                    stop: asyncio.Event) -> None:
        step = 0
        base = max(client.versions.get(fragment, 0), 0)
        while not stop.is_set():
            step += 1
            # Tiny steps of alternating sign: the parameters stay near zero.
            delta = np.full(self.numel, 1e-4 if step % 2 else -1e-4, dtype=np.float32)
            try:
                target = await client.push(fragment, delta, base_version=base, c_tokens=64,
                                           c_steps=1, local_step=step)
            except Refused as refused:
                self.refused[refused.reason] = self.refused.get(refused.reason, 0) + 1
                target = None
            self.pushes += 1
            # Acknowledged into the round for `target`: version target - 1 is committed.
            base = target - 1 if target else max(client.versions.get(fragment, 0), 0)

    async def _heartbeat(self, client: SynchronizerClient, stop: asyncio.Event) -> None:
        """Once a second, as a learner does; it also settles the outbox."""
        while not stop.is_set():
            with contextlib.suppress(Refused, grpc.RpcError):
                await client.heartbeat(0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), client.heartbeat_interval_s)

    async def close(self) -> None:
        for client in self.clients:
            await client.leave("done")
            await client.close()


class CommitCounter:
    """Commits so far (the fragments' versions summed; version 0 is none), from
    Admin.Status on one channel kept across daemon restarts, so that the daemon's
    descriptors are not counted with a connection per sample."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.AdminStub(self.channel)
        self.last = 0

    async def read(self) -> int:
        status = await self.stub.Status(pb.StatusRequest(), timeout=30, wait_for_ready=True)
        self.last = sum(max(f.version, 0) for f in status.fragments)
        return self.last

    async def close(self) -> None:
        await self.channel.close(grace=None)


# -- checkpoints ----------------------------------------------------------------------

def versions_of(daemon: Daemon) -> dict[int, int]:
    return {f.fragment: f.version for f in daemon.status().fragments}


def wait_settled(daemon: Daemon, timeout: float = 30.0, quiet_s: float = 0.3) -> dict[int, int]:
    """The versions, once no round is open and none has changed for `quiet_s`: a
    closed round is published only once its version is written."""
    deadline = time.monotonic() + timeout
    last: dict[int, int] = {}
    since = time.monotonic()
    while time.monotonic() < deadline:
        status = daemon.status()
        versions = {f.fragment: f.version for f in status.fragments}
        if versions != last or any(f.round_learners for f in status.fragments):
            last, since = versions, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return versions
        time.sleep(0.02)
    raise TimeoutError("versions still changing after the learners stopped")


def time_resume(state_dir: Path, repeats: int) -> list[float]:
    """Seconds `Engine.start()` takes to resume from `state_dir`, `repeats` times (the
    first after a crash also mends what the crash left)."""
    async def once() -> float:
        engine = Engine(CoordinatorConfig(state_dir=str(state_dir), fsync=False))
        started = time.perf_counter()
        await engine.start()
        elapsed = time.perf_counter() - started
        await engine.stop()
        return elapsed

    return [asyncio.run(once()) for _ in range(repeats)]


def checkpoint(daemon: Daemon, repeats: int) -> dict[str, Any]:
    """Crash the daemon, time resume, the whole-log baseline and a restart."""
    before = wait_settled(daemon)
    daemon.kill()
    state = daemon.state_dir
    first_resume, *resume = time_resume(state, repeats + 1)
    started = time.perf_counter()
    history = read_manifests(state)
    history_s = time.perf_counter() - started
    started = time.perf_counter()
    daemon.start()
    after = versions_of(daemon)
    restart_s = time.perf_counter() - started
    if after != before:
        raise RuntimeError(f"resumed at versions {after}, but the daemon had {before}")
    active = state / "manifests.jsonl"
    return {
        "commits": sum(max(v, 0) for v in before.values()),
        "resume_s": statistics.median(resume), "resume_min_s": min(resume),
        "resume_after_crash_s": first_resume,
        "resume_runs_s": [round(r, 5) for r in resume],
        "history_records": len(history), "history_read_s": history_s,
        "restart_s": restart_s,
        "active_segment_bytes": active.stat().st_size if active.exists() else 0,
        "sealed_segments": len(list((state / "manifests").glob("*.jsonl"))),
        "state_dir_bytes": directory_bytes(state),
        "versions": before,
    }


def audit_trail(state_dir: Path, versions: dict[int, int]) -> dict[str, Any]:
    """The audit trail holds, per fragment, contiguous versions ending at the last,
    and no contribution id twice. Every commit logs one record (version 0 too), so
    fewer records than commits means the oldest segments were deleted, which must
    leave at least the kept window of `KEEP_SEGMENTS` full segments."""
    records = read_manifests(state_dir)
    seen: dict[int, list[int]] = {}
    ids: set[tuple[str, int, int]] = set()
    doubled = 0
    for record in records:
        fragment = int(record["fragment"])
        seen.setdefault(fragment, []).append(int(record["version"]))
        for item in record["manifest"]:
            cid = (str(item["learner"]), fragment, int(item["seq"]))
            doubled += cid in ids
            ids.add(cid)
    gaps = [p for p, vs in seen.items()
            if vs != list(range(vs[0], vs[0] + len(vs))) or vs[-1] != versions[p]]
    logged = sum(v + 1 for v in versions.values())
    kept_bytes = sum(len(json.dumps(record)) + 1 for record in records)
    # Each sealed segment is at least SEGMENT_BYTES long, its snapshot line included.
    short = len(records) < logged and kept_bytes < 0.95 * KEEP_SEGMENTS * SEGMENT_BYTES
    if doubled or gaps or short:
        raise RuntimeError(f"audit trail: {len(records)} records ({kept_bytes} bytes) of "
                           f"{logged} commits, {doubled} contributions twice, fragments with "
                           f"gaps or a wrong last version: {gaps}")
    return {"records": len(records), "record_bytes": kept_bytes, "commits_logged": logged,
            "contributions": len(ids), "doubled": doubled}


# -- the run ----------------------------------------------------------------------------

async def soak(daemon: Daemon, args: argparse.Namespace,
               checkpoints: list[int]) -> dict[str, Any]:
    fleet = Fleet(daemon.address, args.numel, args.fragments)
    await fleet.join()
    counter = CommitCounter(daemon.address)
    samples: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    life = 0
    started = time.monotonic()
    sampling = True

    async def sampler() -> None:
        while sampling:
            if daemon.process is not None and daemon.process.poll() is None:
                with contextlib.suppress(OSError, grpc.RpcError):
                    commits = await counter.read()
                    probe = sample_process(daemon_pid(daemon))
                    samples.append({
                        "t": round(time.monotonic() - started, 2), "commits": commits,
                        "life": life, "rss_mb": round(probe.rss_bytes / 1e6, 2),
                        "fds": probe.fds,
                        "state_kb": round(directory_bytes(daemon.state_dir) / 1e3, 1)})
            await asyncio.sleep(args.sample_s)

    sampling_task = asyncio.create_task(sampler())
    try:
        for target in checkpoints:
            await fleet.run(target, counter)
            log(f"  {counter.last:,} commits in {time.monotonic() - started:.0f} s; "
                f"crash and resume")
            result = await asyncio.to_thread(checkpoint, daemon, args.resume_repeats)
            life += 1
            results.append(result)
            log(f"  resume {1e3 * result['resume_s']:.1f} ms (median of "
                f"{args.resume_repeats}; the first, after the crash, "
                f"{1e3 * result['resume_after_crash_s']:.1f} ms); the whole audit trail "
                f"({result['history_records']:,} records) read in "
                f"{1e3 * result['history_read_s']:.0f} ms; restart {result['restart_s']:.2f} s; "
                f"state dir {result['state_dir_bytes'] / 1e6:.2f} MB")
    finally:
        sampling = False
        await sampling_task
        await fleet.close()
        await counter.close()
    wall = time.monotonic() - started
    return {"checkpoints": results, "samples": samples, "wall_s": wall,
            "pushes": fleet.pushes, "refused": fleet.refused}


def flatness(samples: list[dict[str, Any]], key: str, last_life: int) -> dict[str, Any]:
    """first/last/max of `key` over daemon life `last_life`, and its slope per 10k
    commits after that life's first 10%."""
    life = [s for s in samples if s["life"] == last_life]
    if not life:
        return {}
    lo, hi = life[0]["commits"], life[-1]["commits"]
    settled = [s for s in life if s["commits"] >= lo + 0.1 * (hi - lo)]
    return {"life_commits": [lo, hi], "first": life[0][key], "last": life[-1][key],
            "max": max(s[key] for s in life),
            "slope_per_10k_commits": slope_per([s["commits"] for s in settled],
                                               [s[key] for s in settled], 10_000)}


def size_flags(parser: argparse.ArgumentParser, fragments: int, numel: int,
               sample_s: float, sampled: str) -> None:
    """The flags both this and `bench.load` take: the fragments and the sampling."""
    parser.add_argument("--fragments", type=int, default=fragments,
                        help=f"fragments (default {fragments})")
    parser.add_argument("--numel", type=int, default=numel,
                        help=f"fp32 parameters per fragment (default {numel})")
    parser.add_argument("--sample-s", type=float, default=sample_s,
                        help=f"seconds between samples of {sampled} (default {sample_s:g})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=100_000,
                        help="commits in all (default 100,000)")
    parser.add_argument("--checkpoints", default="1000,10000,100000",
                        help="commit counts to crash and resume at, comma-separated; those "
                             "above --commits are skipped and --commits is always one")
    size_flags(parser, fragments=4, numel=16, sample_s=1.0,
               sampled="RSS, descriptors and size")
    parser.add_argument("--resume-repeats", type=int, default=15,
                        help="in-process resumes timed per checkpoint after the first, "
                             "which mends the crash and is reported apart (default 15)")
    parser.add_argument("--out", type=Path, help="keep the state directory here")
    args = parser.parse_args(argv)
    checkpoints = sorted({c for c in map(int, args.checkpoints.split(","))
                          if 0 < c < args.commits} | {args.commits})
    load_before = os.getloadavg()
    log(f"soak: {args.commits:,} commits, {args.fragments} fragments of {args.numel} "
        f"parameters, checkpoints {checkpoints}; load average {load_before[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="ftsync-bench-soak-") as tmp:
        root = args.out or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        daemon = Daemon(state_dir=root / "state", args=[
            "--min-quorum", "1", "--set", "policy.grace_max_s=0", "--set", "fsync=false"])
        daemon.start()
        try:
            run = asyncio.run(soak(daemon, args, checkpoints))
            final = run["checkpoints"][-1]
            audit = audit_trail(daemon.state_dir, final["versions"])
        finally:
            daemon.stop()
    first, last = run["checkpoints"][0], run["checkpoints"][-1]
    growth = last["resume_s"] / first["resume_s"]
    commits = last["commits"]
    emit({
        "name": "soak",
        "ratio": growth,
        "target": RESUME_GROWTH_TARGET,
        "unit": f"resume time at {last['commits']:,} commits / at {first['commits']:,}",
        "resume_growth": growth,
        # The same from the fastest resume of each checkpoint: the code's own cost,
        # without what the machine's other work added.
        "resume_growth_min": last["resume_min_s"] / first["resume_min_s"],
        "commits": commits,
        "wall_s": run["wall_s"],
        "commits_per_s": commits / run["wall_s"],
        "fragments": args.fragments,
        "numel": args.numel,
        "resume_ms": {c["commits"]: round(1e3 * c["resume_s"], 3) for c in run["checkpoints"]},
        "history_read_ms": {c["commits"]: round(1e3 * c["history_read_s"], 1)
                            for c in run["checkpoints"]},
        "restart_s": {c["commits"]: round(c["restart_s"], 3) for c in run["checkpoints"]},
        "state_dir_bytes": {c["commits"]: c["state_dir_bytes"] for c in run["checkpoints"]},
        # The last full life: from the restart at the last checkpoint but one.
        "rss_mb": flatness(run["samples"], "rss_mb", len(checkpoints) - 1),
        "fds": flatness(run["samples"], "fds", len(checkpoints) - 1),
        "state_kb": flatness(run["samples"], "state_kb", len(checkpoints) - 1),
        "audit": audit,
        "pushes": run["pushes"],
        "refused": run["refused"],
        "checkpoints": run["checkpoints"],
        "samples": run["samples"],
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    })


if __name__ == "__main__":
    main()
