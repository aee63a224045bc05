"""Wide-area benchmark: push + pull of a whole model through the real daemon over an
emulated long link, against the link-rate bound, for fp32 and each codec.

A real `python -m coordinator` process (`fsync=false`: the network path, not the disk) and
a real learner client (`learner.client.SynchronizerClient`, whatever transport it picks)
talk through the fault proxy run as a process of its own (`python -m chaos.proxy`) set to
a link of `--latency-ms` one way (default 25) and `--bandwidth-mbit` in each direction
(default 1000: 1 Gbit/s). The proxy forwards any TCP and listens on 127.0.0.2, mirroring
every port the daemon listens on besides its gRPC one: a second connection the protocol
opens to "the coordinator's host, port N" (a bulk channel) crosses the same link and cannot
go around it; `connections_by_port` says which of the daemon's ports the connections
went to (a mirrored port's: a second channel carried bytes).

One exchange is what a learner does with each fragment: push an outer gradient, and once
every push is acknowledged, pull the merged version back. All fragments are pushed at once
and pulled at once (one round trip each way for all of them), the merge and outer step
inside the timed window. The link-rate bound of an exchange is what the link alone costs:
`bytes_up / bandwidth + bytes_down / bandwidth + 2 round trips` (the push and its ack, the
pull and its answer), with the tensor bytes the codec puts in its chunks (framing is ours
to pay). **ratio** = fp32 bound / fp32 exchange time (target ≥ 0.85). **int8_speedup** and
**e3m0_speedup** = fp32 exchange time / that codec's (targets ≥ 3 and ≥ 5): pushes travel
in the codec, and so do pulls, as deltas against the coordinator's reference of that codec
(`pull_compressed` says whether they did, from the bytes the link carried down; as fp32
the speedup could not pass 8/5 for int8). Each codec's learner joins afresh under the
same id and runs its exchanges in a row: its first pull, holding no reference of the
codec yet, is the full fp32 version, so the best of the later ones counts (of all three
for fp32). The same exchanges run once more on loopback against a fresh daemon with no
proxy (`loopback_s` per codec): what the CPUs allow, codec work included, with the link
out of the way.

As a same-run reference, a plain TCP socket moves the fp32 bytes up and back through a
second proxy process set to the same link (`bench.transfer`'s raw server: receive all,
then send all back): what the link, the proxy and this machine allow with no RPC, codec
or merge; **ratio_vs_raw** = that time / the fp32 exchange's.

Run from the repository root: `python -m bench.wan [--params N] [--fragments P]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.transfer import (
    CODEC_NAMES,
    MB,
    Floats,
    RawServer,
    base_parser,
    emit,
    fragment_sizes,
    log,
    make_model,
    split,
)
from chaos.local import CoordinatorProcess
from chaos.proxy import LinkSpec, control, listening_ports
from learner.client import Retry, SynchronizerClient
from protos import ftsync_pb2 as pb
from protos.codec import codec_named, iter_chunk_messages

LAYOUT_HASH = "bench-wan-layout"
PULL_WAIT_S = 120.0
MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass
class ProxyProcess:
    """`python -m chaos.proxy` in a process of its own, set to `link` from the start."""

    upstream: str
    link: LinkSpec
    mirror_ports: list[int]
    process: subprocess.Popen[str] | None = None
    address: str = ""
    control: str = ""

    def start(self) -> ProxyProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "chaos.proxy", "--listen", "127.0.0.2:0",
             "--upstream", self.upstream, "--control", "127.0.0.1:0",
             "--latency-ms", str(self.link.latency_ms),
             "--bandwidth-bytes-s", str(self.link.bandwidth_bytes_s),
             *(f"--mirror-port={port}" for port in self.mirror_ports)],
            stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        match = re.search(r"listening on (\S+),.* control on (\S+)$", line.strip())
        if match is None:
            raise RuntimeError(f"the proxy did not start: {line!r} (exit {self.process.poll()})")
        self.address, self.control = match.group(1), match.group(2)
        return self

    def counted(self) -> tuple[int, int]:
        """Bytes it has forwarded so far, up (learner → daemon) and down."""
        state = control(self.control, "describe")
        return int(state["bytes_up"]), int(state["bytes_down"])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


def payload_bytes(values: list[Floats], codec_name: str, chunk_bytes: int) -> int:
    """The tensor bytes `codec_name` puts in the chunks of these fragments."""
    codec = codec_named(codec_name)
    return sum(len(message.chunk.data) for part in values
               for message in iter_chunk_messages(part, codec, pb.PushMessage, chunk_bytes))


async def exchange(client: SynchronizerClient, deltas: list[Floats], version: int,
                   proxy: ProxyProcess | None) -> dict[str, Any]:
    """Push every fragment's outer gradient against `version`, then pull `version + 1`
    (with `proxy`, also the bytes it carried each way)."""
    up0, down0 = proxy.counted() if proxy is not None else (0, 0)
    started = time.perf_counter()
    targets = await asyncio.gather(*(
        client.push(p, delta, base_version=version, c_tokens=4096, c_steps=16,
                    local_step=version + 1) for p, delta in enumerate(deltas)))
    acked = time.perf_counter()
    if any(target != version + 1 for target in targets):
        raise RuntimeError(f"pushes against version {version} joined rounds {targets}")
    pulls = await asyncio.gather(*(client.pull(p, version, PULL_WAIT_S)
                                   for p in range(len(deltas))))
    done = time.perf_counter()
    if any(pulled is None or pulled.version != version + 1 for pulled in pulls):
        raise RuntimeError(f"pulls past version {version} got "
                           f"{[None if p is None else p.version for p in pulls]}")
    up1, down1 = proxy.counted() if proxy is not None else (0, 0)
    return {"seconds": done - started, "push_s": acked - started, "pull_s": done - acked,
            "wire_up": up1 - up0, "wire_down": down1 - down0}


def make_client(address: str, sizes: list[int], codec: str,
                chunk_bytes: int) -> SynchronizerClient:
    """The benchmark's learner, pushing (and pulling deltas) in `codec`."""
    client = SynchronizerClient(address, "bench-wan", LAYOUT_HASH, sizes, codec=codec,
                                retry=Retry(give_up_after_s=120.0))
    client.chunk_bytes = chunk_bytes
    return client


async def run_link(address: str, proxy: ProxyProcess | None, sizes: list[int], theta: Floats,
                   delta: Floats, chunk_bytes: int,
                   rounds: int) -> dict[str, list[dict[str, Any]]]:
    """The warm-up, then `rounds` exchanges per codec, each codec's learner joining
    afresh under the same id (its pulls start from no reference of that codec)."""
    thetas, deltas = split(theta, sizes), split(delta, sizes)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CODEC_NAMES}
    version = 0
    for name in ("init", *CODEC_NAMES):
        client = make_client(address, sizes, "fp32" if name == "init" else name, chunk_bytes)
        try:
            await client.join()
            if name == "init":
                log("warm-up: initial values pushed and pulled back over the link")
                for p, values in enumerate(thetas):
                    await client.push_initial(p, values)
                for p in range(len(sizes)):
                    pulled = await client.pull(p, -1, PULL_WAIT_S)
                    if pulled is None or not np.array_equal(pulled.values[:4096],
                                                            thetas[p][:4096]):
                        raise RuntimeError(f"fragment {p}: version 0 pulled back differs "
                                           f"from the initial value pushed")
                continue
            for _ in range(rounds):
                result = await exchange(client, deltas, version, proxy)
                version += 1
                runs[name].append(result)
                log(f"  {name:>5}: {result['seconds']:.2f} s (push {result['push_s']:.2f} s, "
                    f"pull {result['pull_s']:.2f} s; {result['wire_up'] / MB:.0f} MB up, "
                    f"{result['wire_down'] / MB:.0f} MB down on the link)")
        finally:
            if client.may_be_member:
                await client.leave("benchmark done" if name == CODEC_NAMES[-1]
                                   else "next codec")
            await client.close()
    return runs


def raw_through_link(delta: Floats, link: LinkSpec, repeats: int) -> list[float]:
    """Seconds for a plain socket to move `delta` up and back through the same link."""
    server = RawServer()
    proxy = ProxyProcess(f"127.0.0.1:{server.port}", link, [])
    try:
        proxy.start()
        host, port = proxy.address.rsplit(":", 1)
        sink = np.empty_like(delta)
        runs = [server.roundtrip(delta.data.cast("B"), sink.data.cast("B"), (host, int(port)))
                for _ in range(repeats)]
        if not np.array_equal(delta[-1024:], sink[-1024:]):
            raise RuntimeError("the raw echo through the link corrupted the payload")
        return runs
    finally:
        proxy.stop()
        server.close()


def cpu_model() -> str:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "wan benchmark")
    parser.add_argument("--latency-ms", type=float, default=25.0,
                        help="one-way latency of the link, each direction (default 25)")
    parser.add_argument("--bandwidth-mbit", type=float, default=1000.0,
                        help="bandwidth of the link in Mbit/s, each direction (default 1000)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="exchanges per codec in a row; the best counts (default 3)")
    args = parser.parse_args(argv)
    try:
        link = LinkSpec(latency_ms=args.latency_ms,
                        bandwidth_bytes_s=args.bandwidth_mbit * MBIT)
    except ValueError as exc:
        parser.error(str(exc))
    if not link.bandwidth or args.rounds < 1:
        parser.error("the link needs a bandwidth (--bandwidth-mbit > 0) and --rounds >= 1")
    sizes = fragment_sizes(args.params, args.fragments)
    load_before = os.getloadavg()
    log(f"{args.params:,} fp32 parameters in {args.fragments} fragments "
        f"({4 * args.params / MB:.0f} MB) over {link.latency_ms:g} ms one way and "
        f"{args.bandwidth_mbit:g} Mbit/s; load average {load_before[0]:.2f}")
    theta, delta = make_model(args.params)
    deltas = split(delta, sizes)
    payload = {name: payload_bytes(deltas, name, args.chunk_bytes) for name in CODEC_NAMES}
    log("reference: a plain socket, the fp32 bytes up and back through the same link")
    raw_runs = raw_through_link(delta, link, args.rounds)
    log(f"  {min(raw_runs):.2f} s (runs {', '.join(f'{r:.2f}' for r in raw_runs)})")
    # Staging for every fragment at once (`limits.staging_bytes`; the default is two of
    # them): one learner's pushes of all its fragments are in flight together over the
    # link, and with two staging buffers the last two would wait for the first two.
    settings = ["--set", "fsync=false", "--set", f"limits.staging_bytes={4 * sum(sizes)}"]
    with tempfile.TemporaryDirectory(prefix="ftsync-bench-wan-") as tmp:
        daemon = CoordinatorProcess(state_dir=Path(tmp) / "state",
                                    args=settings).start()
        assert daemon.process is not None
        mirrored = [p for p in listening_ports(daemon.process.pid) if p != daemon.port]
        proxy = ProxyProcess(daemon.address, link, mirrored)
        try:
            proxy.start()
            runs = asyncio.run(run_link(proxy.address, proxy, sizes, theta, delta,
                                        args.chunk_bytes, args.rounds))
            routes = control(proxy.control, "describe")["connections_by_port"]
        finally:
            proxy.stop()
            daemon.stop()
        log("reference: the same exchanges on loopback, no link (what the CPUs allow)")
        daemon = CoordinatorProcess(state_dir=Path(tmp) / "state-loopback",
                                    args=settings).start()
        try:
            loopback = asyncio.run(run_link(daemon.address, None, sizes, theta, delta,
                                            args.chunk_bytes, args.rounds))
        finally:
            daemon.stop()
    rate = link.bandwidth
    assert rate is not None
    round_trips_s = 2 * (2 * link.latency_ms / 1000)
    codecs: dict[str, Any] = {}
    # A codec's first exchange pulls fp32 (no reference of the codec held yet); the
    # steady state is the rest.
    steady = {name: runs[name][1:] if name != "fp32" and len(runs[name]) > 1 else runs[name]
              for name in CODEC_NAMES}
    best = {name: min(steady[name], key=lambda r: r["seconds"]) for name in CODEC_NAMES}
    on_loopback = {name: min(r["seconds"] for r in (
        loopback[name][1:] if name != "fp32" and len(loopback[name]) > 1 else loopback[name]))
        for name in CODEC_NAMES}
    compressed: dict[str, bool] = {}
    for name in CODEC_NAMES:
        result = best[name]
        # Pulls in the codec when the link carried clearly fewer bytes down than fp32's.
        compressed[name] = result["wire_down"] < 0.9 * payload["fp32"]
        pulled = payload[name] if compressed[name] else payload["fp32"]
        bound = (payload[name] + pulled) / rate + round_trips_s
        codecs[name] = {
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()},
            "runs_s": [round(r["seconds"], 3) for r in runs[name]],
            "payload_up": payload[name], "payload_down": pulled,
            "bound_s": round(bound, 4), "of_bound": bound / result["seconds"],
            "speedup_vs_fp32": best["fp32"]["seconds"] / result["seconds"],
            "push_speedup_vs_fp32": best["fp32"]["push_s"] / result["push_s"],
            "wire_overhead": (result["wire_up"] + result["wire_down"])
            / (payload[name] + pulled) - 1,
            "loopback_s": round(on_loopback[name], 4),
            "loopback_speedup_vs_fp32": on_loopback["fp32"] / on_loopback[name],
        }
    emit({
        "name": "wan",
        "ratio": codecs["fp32"]["of_bound"],
        "target": 0.85,
        "unit": "fp32 push+pull link-rate bound / measured time",
        "ratio_vs_raw": min(raw_runs) / codecs["fp32"]["seconds"],
        "raw_s": round(min(raw_runs), 4),
        "raw_runs_s": [round(r, 3) for r in raw_runs],
        "raw_of_bound": (2 * payload["fp32"] / rate + 2 * link.latency_ms / 1000)
        / min(raw_runs),
        "int8_speedup": codecs["int8"]["speedup_vs_fp32"],
        "int8_target": 3.0,
        "e3m0_speedup": codecs["e3m0"]["speedup_vs_fp32"],
        "e3m0_target": 5.0,
        "bf16_speedup": codecs["bf16"]["speedup_vs_fp32"],
        "int8_push_speedup": codecs["int8"]["push_speedup_vs_fp32"],
        "e3m0_push_speedup": codecs["e3m0"]["push_speedup_vs_fp32"],
        "pull_compressed": {name: compressed[name] for name in CODEC_NAMES if name != "fp32"},
        "grpc_port": daemon.port,
        "mirrored_ports": mirrored,
        "connections_by_port": routes,
        "link": {"latency_ms": link.latency_ms, "bandwidth_mbit": args.bandwidth_mbit},
        "params": args.params,
        "fragments": args.fragments,
        "chunk_bytes": args.chunk_bytes,
        "mb": "1e6 bytes",
        "codecs": codecs,
        "cpu": cpu_model(),
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    })


if __name__ == "__main__":
    main()
