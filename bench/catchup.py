"""Catch-up benchmark: a restarted learner loading a 100M-parameter model from a peer,
against moving the same bytes over a raw socket, both measured in one run.

A real daemon (`python -m coordinator`, fsync off) and a peer learner process (the
`tests.integration.learner_worker` model: embedding tables, 4 fragments) that joins,
pushes the initial values, trains until every fragment has been merged once (version 1)
and then idles, serving its fragments. Each measured learner is a fresh process that
builds the same model, starts a `Learner` with the peer's address and takes one
training step. The catch-up is timed from the call of `Learner.start()` to its return
(join, the published version vector, every fragment fetched at those versions and
written into the model, the background loop running): from then on every step's work
counts. Process start-up (the interpreter, `import torch`) and building the model
come before `start()`, take the same time whatever the recovery path, and do not
depend on the bytes moved, so they are reported beside the ratio, not in it, as is the
whole span from spawning the process to the end of its first step.

The baseline is a socket server in its own process sending the same bytes with
`sendall` from one buffer; the benchmark receives them with `recv_into` into a freshly
allocated buffer, as a catching-up learner must. Two raw transfers run before each
catch-up and one after the last, so a change in the machine's load reaches both.
Beside the ratio, after each catch-up, the same raw transfer is received by a fresh
process that has imported torch and built a model of the same size first, as the
catching-up learner has: what the bytes cost in the learner's memory situation.

Six fresh learners catch up over the bulk transport (the default), then one over the
gRPC stream transport and one from the coordinator alone, for comparison. The ratio
takes the best catch-up and the best raw transfer, as `bench.transfer` does; the
ratio of the medians is reported beside it.

Run from the repository root: `python -m bench.catchup [--params N] [--fragments P]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from chaos.local import CoordinatorProcess as Daemon
from protos import peer_pb2 as peer_pb
from protos import peer_pb2_grpc as peer_grpc

MB = 1e6
TARGET = 1.5
# Pause before each raw transfer, for the last learner's exit (freeing its memory)
# to settle.
SETTLE_S = 0.5
RAW_PER_RUN = 2
ROOT = Path(__file__).resolve().parents[1]
WORKER = [sys.executable, "-m", "tests.integration.learner_worker"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the raw-socket baseline -------------------------------------------------------------

_RAW_SENDER = r"""
import socket, sys
import numpy as np
data = np.random.default_rng(0).standard_normal(int(sys.argv[1]), dtype=np.float32)
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    conn, _ = server.accept()
    with conn:
        if conn.recv(1) != b"s":
            break
        try:
            conn.sendall(data.data.cast("B"))
        except OSError:  # a receiver that died: the next one still gets served
            pass
"""


# A fresh process in the catching-up learner's situation: torch imported and a model
# of the same size built (its memory written) before the timed receive into a fresh
# buffer. Beside the ratio: the same transfer with the learner's memory costs.
_RAW_FRESH_RECEIVER = r"""
import sys
import torch
from bench.catchup import receive_raw
port, numel = int(sys.argv[1]), int(sys.argv[2])
model = torch.empty(numel).normal_()
print(receive_raw(port, numel), flush=True)
"""


def receive_raw(port: int, numel: int) -> float:
    """Seconds to receive `numel` fp32 values from the raw sender into a fresh buffer."""
    started = time.perf_counter()
    values = np.empty(numel, dtype=np.float32)
    view = values.data.cast("B")
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(b"s")
        got = 0
        while got < view.nbytes:
            n = conn.recv_into(view[got:], view.nbytes - got)
            if n == 0:
                raise RuntimeError("raw sender closed early")
            got += n
    return time.perf_counter() - started


class RawSender:
    """A process that sends `numel` fp32 values to whoever connects and asks."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.process = subprocess.Popen([sys.executable, "-c", _RAW_SENDER, str(numel)],
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())

    def receive(self) -> float:
        """Seconds to receive every byte into a fresh buffer, in this process."""
        return receive_raw(self.port, self.numel)

    def receive_in_fresh_process(self) -> float:
        """Seconds to receive every byte in a new process that built a model first."""
        result = subprocess.run([sys.executable, "-c", _RAW_FRESH_RECEIVER, str(self.port),
                                 str(self.numel)], cwd=ROOT, capture_output=True, text=True,
                                timeout=300, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"fresh-process raw receiver failed ({result.returncode}):\n"
                               f"{result.stderr[-3000:]}")
        return float(result.stdout.strip())

    def close(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port)) as conn:
            conn.sendall(b"q")
        self.process.wait(timeout=10)


# -- learners --------------------------------------------------------------------------


def size_args(params: int, fragments: int) -> list[str]:
    return ["--params", str(params), "--fragments", str(fragments), "--sync-every", "4",
            "--step-ms", "0"]


async def holdings(address: str) -> dict[int, set[int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        held = await peer_grpc.PeerFragmentsStub(channel).ListHoldings(
            peer_pb.HoldingsRequest(), timeout=10)
    result: dict[int, set[int]] = {}
    for status in held.fragments:
        result.setdefault(status.fragment, set()).add(status.version)
    return result


def wait_for_peer(daemon: Daemon, address: str, timeout: float = 300.0) -> dict[int, int]:
    """Until the peer holds every published version, each at least 1; returns them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        published = {f.fragment: f.version for f in daemon.status().fragments}
        held = asyncio.run(holdings(address))
        if published and min(published.values()) >= 1 and all(
                v in held.get(p, set()) for p, v in published.items()):
            return published
        time.sleep(0.1)
    raise TimeoutError("the peer never held every published version")


def catch_up_once(daemon: Daemon, learner_id: str, size: list[str],
                  extra: list[str]) -> dict[str, Any]:
    """One fresh learner process: spawn, catch up, one step; its timings."""
    spawned = time.monotonic()
    result = subprocess.run(
        [*WORKER, "catchup", "--coordinator", daemon.address, "--learner-id", learner_id,
         *size, "--first-step", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"catch-up learner failed ({result.returncode}):\n"
                           f"{result.stderr[-3000:]}")
    record: dict[str, Any] = json.loads(lines[-1])
    return {
        "catch_up_s": record["ended"] - record["began"],
        "sources": sorted(set(record["sources"].values())),
        "versions": record["versions"],
        "bytes_from_peers": record["bytes_from_peers"],
        "bytes_from_coordinator": record["bytes_from_coordinator"],
        "first_step_s": record["first_step_ended"] - record["ended"],
        # From spawning the process: interpreter and imports, model, then start().
        "imports_s": record["imported"] - spawned,
        "model_build_s": record["model_built"] - record["imported"],
        "process_to_first_step_s": record["first_step_ended"] - spawned,
    }


def measure_catchup(params: int = 100_000_000, fragments: int = 4,
                    bulk_runs: int = 6) -> dict[str, Any]:
    """The benchmark; returns the JSON line's object."""
    # What the worker's model holds: `fragments` tables of 64-wide rows and a head.
    numel = max(1, params // fragments // 64) * 64 * fragments + 64 + 1
    nbytes = 4 * numel
    log(f"{params:,} parameters in {fragments} fragments ({nbytes / MB:.0f} MB); "
        f"load average {os.getloadavg()[0]:.2f}")
    size = size_args(params, fragments)
    raw = RawSender(numel)
    raw_runs: list[float] = []
    fresh_raw_runs: list[float] = []
    runs: dict[str, list[dict[str, Any]]] = {"bulk": [], "grpc": [], "coordinator": []}
    try:
        raw.receive()  # warm-up
        with tempfile.TemporaryDirectory(prefix="ftsync-bench-catchup-") as tmp:
            daemon = Daemon(state_dir=Path(tmp) / "state",
                            args=["--set", "fsync=false", "--set", "policy.grace_max_s=0"])
            daemon.start()
            peer = subprocess.Popen(
                [*WORKER, "train", "--coordinator", daemon.address, "--learner-id", "peer",
                 # H = 4: 7 steps push each fragment exactly once (offsets < H).
                 *size, "--steps", "7", "--serve-peers", "127.0.0.1:0"],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert peer.stdout is not None
                peer_address = json.loads(peer.stdout.readline())["peer_address"]
                versions = wait_for_peer(daemon, peer_address)
                log(f"peer at {peer_address} holds versions {versions}")
                plan = [("bulk", ["--peers", peer_address])] * bulk_runs + [
                    ("grpc", ["--peers", peer_address, "--transport", "grpc"]),
                    ("coordinator", [])]
                for i, (mode, extra) in enumerate(plan):
                    # Raw transfers interleave with the catch-ups, so a change in the
                    # machine's load reaches both alike.
                    for _ in range(RAW_PER_RUN):
                        time.sleep(SETTLE_S)
                        raw_runs.append(raw.receive())
                    run = catch_up_once(daemon, f"late-{i}", size, extra)
                    runs[mode].append(run)
                    time.sleep(SETTLE_S)  # as before the other raw transfers
                    fresh_raw_runs.append(raw.receive_in_fresh_process())
                    log(f"  {mode:>11}: catch-up {run['catch_up_s']:.3f} s from "
                        f"{run['sources']} (raw socket {min(raw_runs[-RAW_PER_RUN:]):.3f} s, "
                        f"in a fresh process {fresh_raw_runs[-1]:.3f} s); "
                        f"process start to first step {run['process_to_first_step_s']:.2f} s")
            finally:
                if peer.poll() is None and peer.stdin is not None:
                    peer.stdin.close()
                    peer.wait(timeout=60)
                daemon.stop()
        raw_runs.append(raw.receive())
    finally:
        raw.close()

    raw_s = min(raw_runs)
    best = {mode: min(rs, key=lambda r: r["catch_up_s"]) for mode, rs in runs.items()}
    headline = best["bulk"]
    if headline["bytes_from_coordinator"]:
        log("note: part of the headline catch-up came from the coordinator")
    bulk_median = float(np.median([r["catch_up_s"] for r in runs["bulk"]]))
    raw_median = float(np.median(raw_runs))
    return {
        "name": "catchup",
        "ratio": headline["catch_up_s"] / raw_s,
        "target": TARGET,
        "unit": "Learner.start() catch-up time / raw-socket time for the same bytes "
                "(best of each)",
        "params": numel,
        "fragments": fragments,
        "bytes": nbytes,
        "catch_up_s": headline["catch_up_s"],
        "raw_s": raw_s,
        "raw_mb_s": nbytes / raw_s / MB,
        "catch_up_mb_s": nbytes / headline["catch_up_s"] / MB,
        "median_ratio": bulk_median / raw_median,
        "catch_up_median_s": bulk_median,
        "raw_median_s": raw_median,
        "grpc_transport_ratio": best["grpc"]["catch_up_s"] / raw_s,
        "coordinator_ratio": best["coordinator"]["catch_up_s"] / raw_s,
        # The whole span from spawning the learner process to the end of its first step.
        "process_to_first_step_s": headline["process_to_first_step_s"],
        "process_to_first_step_ratio": headline["process_to_first_step_s"] / raw_s,
        # The raw transfer in a fresh process that built the model first, as a
        # catching-up learner is (best of one per catch-up), and the ratio against it.
        "raw_fresh_process_s": min(fresh_raw_runs),
        "ratio_to_fresh_process_raw": headline["catch_up_s"] / min(fresh_raw_runs),
        "raw_fresh_process_runs_s": [round(r, 4) for r in fresh_raw_runs],
        "runs": runs,
        "raw_runs_s": [round(r, 4) for r in raw_runs],
        "load_average": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--params", type=int, default=100_000_000,
                        help="parameters of the model (default 100M)")
    parser.add_argument("--fragments", type=int, default=4, help="fragments P (default 4)")
    parser.add_argument("--bulk-runs", type=int, default=6,
                        help="fresh learners caught up over the bulk transport; the best "
                             "counts (default 6)")
    args = parser.parse_args(argv)
    print(json.dumps(measure_catchup(args.params, args.fragments, args.bulk_runs)),
          flush=True)


if __name__ == "__main__":
    main()
