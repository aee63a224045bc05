"""Convergence benchmark: asynchronous ftsync against lock-step DiLoCo and a single process,
at the same token budget, with and without a straggler, all measured in one run.

Four `ftsync-learner` processes (one torch thread each) train `lm-stdlib` on shards 0..3
through a real `python -m coordinator` process, in these configurations:

- (a) **async**: quorum 1, grace window on, staleness weighting on; learners free-running.
- (b) **sync**: the same daemon with `--sync-mode 4` (quorum 4, no grace, no stale
  contributions) and learners
  with `--lockstep` (each waits for a merged fragment when it is due): lock-step DiLoCo
  with DiLoCo's outer optimizer. (b1), run only when asked for (`--only`), is the same
  with outer lr 1 and no momentum, plain parameter averaging, as a second sync
  reference.
- (c) **single**: one training loop in this process, batch = 4 × the learners' batch made
  of one batch from each of the four shards' streams (the same data the learners see),
  AdamW as the task defines it, no coordinator: the data-parallel equivalent.

Then (a) and (b) again with learner 3 slowed 3×. With `--wan`, (a) and (b) once more as
(wa) and (wb) with every learner behind a fault proxy of its own (`chaos.proxy`, in this
process, carrying every port of the coordinator) set to a cross-region link
(`--wan-latency-ms`, default 25 ms one way, and `--wan-mbit`, default 100 Mbit/s, each
direction): DiLoCo exists for slow long links, and on loopback a round trip costs
nothing, so lock-step's wait hides inside τ steps.

Each learner step sleeps `--device-ms` (`ftsync-learner --step-ms`) to stand in for an
accelerator: four CPU-bound learners on a two-core machine would share the cores, so a
stopped learner would hand its CPU to the others and no learner would run at its own
speed. With the sleep, the learners use about one core in all and each runs as if on a
device of its own. The straggler is slowed 3× in both parts of its step: its emulated
accelerator time is 3× longer, and a SIGSTOP/SIGCONT duty cycle from this process stops
it for 2/3 of every 100 ms period from its first step on, so its CPU work takes 3× longer.

The token budget is a total for the run: 4 × steps × tokens per learner step. The
benchmark follows each learner's progress lines and, once the steps summed over the four
learners reach the budget, records the time and sends SIGTERM to every learner still
running (an `ftsync-learner` finishes its step, evaluates, flushes its pushes and prints
its summary). Sync learners get a cap of exactly `steps` each, so they finish on their
own at the budget; async learners get no useful cap, so in the straggler run the three
healthy learners cover what the straggler does not. The straggler's tokens count towards
the budget even when its stale contributions are dropped. Wall-clock runs from the moment
the first learner starts training (after its join and first evaluation) to the moment the
budget is reached; the start-up before it is reported apart. For (c), wall-clock is its
training loop's time plus the same emulated accelerator time per step (added, not slept).

Held-out loss: after the learners have left and the open rounds have closed, the final
global model (every fragment's last committed version, read from the daemon's state
directory) is evaluated on the task's held-out split; the mean of the learners' own
end-of-run evaluations is reported beside it.

**ratio** = loss(a) / loss(b) (target ≤ 1.03); **straggler_ratio** = wall(b) / wall(a)
with the straggler (target ≥ 1.5); **wan_wall_ratio** = wall(wb) / wall(wa) (target ≥ 1.3)
at **wan_loss_ratio** = loss(wa) / loss(wb) (target ≤ 1.03). With `--only ai,ai32`, (ai)
async with int8 pushes and int8 delta pulls against (ai32) the same with fp32 pulls:
**delta_pull_loss_ratio** = loss(ai) / loss(ai32) (target ≤ 1.01), and the coordinator's
tensor bytes in and out of each (`delta_pull_bytes`).

Run from the repository root: `python -m bench.convergence [--quick] [--wan]`. Progress goes to
stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from chaos.local import CoordinatorProcess
from chaos.proxy import LinkSpec, ThreadedProxy, listening_ports
from coordinator.durability import StateDir

LEARNERS = 4
STRAGGLER = LEARNERS - 1
TASK = "lm-stdlib"
PROGRESS = re.compile(r"^\S+ step (\d+) ")
# A configuration that has not reached its budget by then is stuck.
CONFIG_TIMEOUT_S = 900.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Settings:
    size: str
    steps: int  # per learner, at an even split of the budget
    sync_every: int
    fragments: int
    overlap: int
    grace_max_s: float
    async_outer: tuple[float, float]
    sync_outer: tuple[float, float]
    staleness_exponent: float
    device_ms: float
    slowdown: float
    period_s: float
    baseline_threads: int
    progress_every: int
    out: Path
    wan: LinkSpec = field(default_factory=LinkSpec)


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    sync: bool
    straggler: bool
    # Sync with outer lr 1 and no momentum: plain parameter averaging (local SGD), a
    # second sync reference beside DiLoCo's outer optimizer.
    averaging: bool = False
    # Every learner behind a proxy of its own set to the `Settings.wan` link.
    wan: bool = False
    # The learners' --compression, and whether they pull deltas in it too.
    compression: str = "fp32"
    compressed_pulls: bool = False


CONFIGS = {c.key: c for c in (
    Config("a", "async (quorum 1, grace, staleness weights)", sync=False, straggler=False),
    Config("b", "sync (--sync-mode 4, --lockstep)", sync=True, straggler=False),
    Config("b1", "sync, outer lr 1 and no momentum (plain averaging)", sync=True,
           straggler=False, averaging=True),
    Config("sa", "async, learner 3 slowed 3x", sync=False, straggler=True),
    Config("sb", "sync, learner 3 slowed 3x", sync=True, straggler=True),
    Config("wa", "async over a cross-region link", sync=False, straggler=False, wan=True),
    Config("wb", "sync over a cross-region link", sync=True, straggler=False, wan=True),
    Config("ai", "async, int8 pushes and int8 delta pulls", sync=False, straggler=False,
           compression="int8", compressed_pulls=True),
    Config("ai32", "async, int8 pushes and fp32 pulls", sync=False, straggler=False,
           compression="int8"),
)}


@dataclass
class LearnerProc:
    """One learner process and what its stdout has said so far."""

    index: int
    process: subprocess.Popen[str]
    step: int = 0
    started_at: float | None = None
    summary: dict[str, Any] | None = None
    reader: threading.Thread | None = None

    def follow(self) -> None:
        assert self.process.stdout is not None
        self.reader = threading.Thread(target=self._read, args=(self.process.stdout,),
                                       name=f"learner-{self.index}-stdout", daemon=True)
        self.reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            match = PROGRESS.match(line)
            if match:
                self.step = int(match.group(1))
            elif line.startswith("{"):
                self.summary = json.loads(line)
                self.step = int(self.summary["steps"])
            elif "held-out loss" in line and self.started_at is None:
                self.started_at = time.monotonic()


class DutyCycle:
    """Slows a process by stopping it for a share of every period (SIGSTOP/SIGCONT)."""

    def __init__(self, pid: int, period_s: float, slowdown: float) -> None:
        self.pid = pid
        self.period_s = period_s
        self.stopped_share = 1.0 - 1.0 / slowdown
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="duty-cycle", daemon=True)

    def start(self) -> DutyCycle:
        self._thread.start()
        return self

    def _run(self) -> None:
        stopped = self.period_s * self.stopped_share
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(stopped)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.period_s - stopped)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Stop cycling and leave the process running."""
        self._done.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)


def coordinator_args(config: Config, s: Settings) -> list[str]:
    lr, momentum = (1.0, 0.0) if config.averaging else (
        s.sync_outer if config.sync else s.async_outer)
    quorum = ["--sync-mode", str(LEARNERS)] if config.sync else [
        "--min-quorum", "1", "--set", f"policy.grace_max_s={s.grace_max_s}"]
    return [*quorum, "--set", f"outer.lr={lr}", "--set", f"outer.momentum={momentum}",
            "--set", "outer.adaptive=false",
            "--set", f"policy.staleness_exponent={s.staleness_exponent}",
            "--set", "fsync=false"]


def learner_command(config: Config, s: Settings, index: int, address: str,
                    run_dir: Path) -> list[str]:
    straggler = config.straggler and index == STRAGGLER
    # Async learners run until the benchmark stops them at the budget.
    cap = s.steps if config.sync else 4 * s.steps
    command = [sys.executable, "-m", "learner", "--coordinator", address,
               "--learner-id", f"learner-{index}", "--task", TASK, "--size", s.size,
               "--shard", str(index), "--num-shards", str(LEARNERS), "--steps", str(cap),
               "--sync-every", str(s.sync_every), "--fragments", str(s.fragments),
               "--overlap", str(s.overlap), "--threads", "1",
               "--step-ms", str(s.device_ms * (s.slowdown if straggler else 1.0)),
               "--progress-every", str(s.progress_every),
               "--compression", config.compression,
               "--event-log", str(run_dir / f"learner-{index}.events.jsonl")]
    if config.compressed_pulls:
        command.append("--compressed-pulls")
    return [*command, "--lockstep"] if config.sync else command


def run_cluster(config: Config, s: Settings) -> dict[str, Any]:
    """One configuration of four learners and a coordinator, to the token budget."""
    run_dir = s.out / config.key
    run_dir.mkdir(parents=True, exist_ok=True)
    args = coordinator_args(config, s)
    coordinator = CoordinatorProcess(state_dir=run_dir / "state", args=args)
    learners: list[LearnerProc] = []
    proxies: list[ThreadedProxy] = []
    duty: DutyCycle | None = None
    budget_steps = LEARNERS * s.steps
    log(f"({config.key}) {config.label}: coordinator {' '.join(args)}")
    try:
        coordinator.start()
        if config.wan:
            # Each on an address of its own, mirroring every port of the coordinator, so
            # no connection a learner opens to "the coordinator's host" goes around its link.
            assert coordinator.process is not None
            mirrored = tuple(port for port in listening_ports(coordinator.process.pid)
                             if port != coordinator.port)
            proxies = [ThreadedProxy(coordinator.address, host=f"127.0.0.{2 + i}", link=s.wan,
                                     mirror_ports=mirrored) for i in range(LEARNERS)]
            for proxy in proxies:
                proxy.start()
        launched = time.monotonic()
        for i in range(LEARNERS):
            stderr = open(run_dir / f"learner-{i}.stderr.log", "w")  # noqa: SIM115
            address = proxies[i].address if proxies else coordinator.address
            process = subprocess.Popen(learner_command(config, s, i, address, run_dir),
                                       stdout=subprocess.PIPE, stderr=stderr, text=True,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
            stderr.close()
            learners.append(LearnerProc(i, process))
            learners[-1].follow()
        reached: float | None = None
        next_log = launched + 15
        while reached is None:
            if config.straggler and duty is None and learners[STRAGGLER].started_at:
                # Slowed from its first step on: its start-up runs at full speed.
                duty = DutyCycle(learners[STRAGGLER].process.pid, s.period_s,
                                 s.slowdown).start()
            done = sum(min(lp.step, s.steps) if config.sync else lp.step for lp in learners)
            if done >= budget_steps:
                reached = time.monotonic()
            elif all(lp.process.poll() is not None for lp in learners):
                codes = [lp.process.returncode for lp in learners]
                raise RuntimeError(f"({config.key}) learners exited before the budget "
                                   f"(codes {codes}); see {run_dir}/learner-*.stderr.log")
            elif time.monotonic() - launched > CONFIG_TIMEOUT_S:
                raise TimeoutError(f"({config.key}) budget not reached after "
                                   f"{CONFIG_TIMEOUT_S:.0f} s at steps "
                                   f"{[lp.step for lp in learners]}")
            elif time.monotonic() >= next_log:
                log(f"  steps {[lp.step for lp in learners]} of {budget_steps} in all, "
                    f"{time.monotonic() - launched:.0f} s")
                next_log += 15
            time.sleep(0.02)
        steps_at_budget = [lp.step for lp in learners]
        started = [lp.started_at for lp in learners]
        first = min(t for t in started if t is not None)
        wall = reached - first
        rates = [round(step / (reached - t), 2) if t is not None and reached > t else 0.0
                 for step, t in zip(steps_at_budget, started, strict=True)]
        if duty is not None:
            duty.stop()
            duty = None
        for lp in learners:
            if lp.process.poll() is None and lp.started_at is None:
                lp.process.kill()  # still starting up: it has done no work to report
            elif lp.process.poll() is None:
                lp.process.send_signal(signal.SIGTERM)
        for lp in learners:
            lp.process.wait(timeout=120)
            assert lp.reader is not None
            lp.reader.join(timeout=10)
        log(f"  budget reached {wall:.1f} s after the first learner started, at steps "
            f"{steps_at_budget} (steps/s {rates})")
        settle_rounds(coordinator, s.grace_max_s + 3.0)
        status = coordinator.status()
        links = [proxy.describe() for proxy in proxies]
    finally:
        if duty is not None:
            duty.stop()
        for lp in learners:
            if lp.process.poll() is None:
                lp.process.kill()
                lp.process.wait()
        for proxy in proxies:
            proxy.stop()
        coordinator.stop()
    summaries = [lp.summary for lp in learners if lp.started_at is not None]
    if any(summary is None for summary in summaries):
        missing = [lp.index for lp in learners
                   if lp.started_at is not None and lp.summary is None]
        raise RuntimeError(f"({config.key}) learners {missing} printed no summary; "
                           f"see {run_dir}/learner-*.stderr.log")
    ends = [float(summary["eval_loss_end"]) for summary in summaries if summary]
    tokens = [int(summary["tokens"]) for summary in summaries if summary]
    global_loss = global_model_loss(run_dir / "state", s)
    starts = [t - launched for t in started if t is not None]
    result = {
        "config": config.key,
        "label": config.label,
        "coordinator_args": args,
        "eval_loss": global_loss,
        "learner_eval_loss_end": ends,
        "learner_eval_loss_mean": sum(ends) / len(ends),
        "eval_loss_start": float(summaries[0]["eval_loss_start"]) if summaries[0] else None,
        "wall_s": round(wall, 2),
        "startup_s": [round(t, 2) for t in starts],
        "launch_to_budget_s": round(reached - launched, 2),
        "steps_at_budget": steps_at_budget,
        "step_rates": rates,
        "steps": [int(summary["steps"]) for summary in summaries if summary],
        "tokens": sum(tokens),
        "learner_tokens": tokens,
        "learner_seconds": [summary["seconds"] for summary in summaries if summary],
        "merged": [summary.get("merged") for summary in summaries if summary],
        "dropped": [summary.get("dropped") for summary in summaries if summary],
        "versions": {f.fragment: f.version for f in status.fragments},
        "rejections": dict(status.rejections),
        # What the coordinator received and sent, in tensor bytes.
        "bytes_in": status.bytes_in,
        "bytes_out": status.bytes_out,
        # What each learner's link carried, up (to the coordinator) and down.
        "link_bytes": [[link["bytes_up"], link["bytes_down"]] for link in links],
    }
    log(f"  global model held-out loss {global_loss:.4f} (learners' own: "
        f"{', '.join(f'{x:.4f}' for x in ends)}); {sum(tokens):,} tokens; "
        f"versions {result['versions']}; dropped {result['dropped']}")
    return result


def settle_rounds(coordinator: CoordinatorProcess, timeout: float) -> None:
    """Wait (bounded) until no fragment has an open round holding contributions."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(f.round_learners for f in coordinator.status().fragments):
            return
        time.sleep(0.05)
    log("  some rounds still hold contributions; evaluating the last committed versions")


def global_model_loss(state_dir: Path, s: Settings) -> float:
    """Held-out loss of the model made of every fragment's last committed version."""
    from learner.fragments import FragmentView, plan_fragments
    from learner.tasks import task_named

    task = task_named(TASK, size=s.size)
    model = task.build_model()
    plan = plan_fragments(model, s.fragments)
    view = FragmentView(model, plan)
    state = StateDir(state_dir, fsync=False)
    for p in range(s.fragments):
        record = state.load_fragment(p)
        if record is None or record.params.size != plan.numels[p]:
            raise RuntimeError(f"fragment {p} in {state_dir} is missing or of another layout")
        view.write(p, record.params)
    return task.eval_loss(model)


def run_single(s: Settings) -> dict[str, Any]:
    """(c): one process, batch = 4 shards' batches together, the same number of tokens."""
    import torch

    from learner.tasks import task_named

    torch.set_num_threads(s.baseline_threads)
    shards = task_named(TASK, size=s.size)
    per_learner_batch = shards.batch_size
    task = task_named(TASK, size=s.size, batch_size=LEARNERS * per_learner_batch)
    log(f"(c) single process: batch {LEARNERS} x {per_learner_batch}, {s.steps} steps, "
        f"{s.baseline_threads} torch threads")
    model = task.build_model()
    optimizer = task.make_optimizer(model)
    streams = [shards.train_batches(i, LEARNERS) for i in range(LEARNERS)]
    start_loss = task.eval_loss(model)
    began = time.monotonic()
    tokens = 0
    loss = torch.tensor(float("nan"))
    for step in range(1, s.steps + 1):
        parts = [next(stream) for stream in streams]
        batch = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        loss, count = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        tokens += count
        if step % max(1, s.steps // 4) == 0:
            log(f"  step {step} loss {float(loss.detach()):.4f}")
    wall = time.monotonic() - began
    end_loss = task.eval_loss(model)
    # The learners' emulated accelerator time, once per step, added rather than slept.
    emulated = wall + s.steps * s.device_ms / 1000
    log(f"  held-out loss {end_loss:.4f} after {wall:.1f} s of compute "
        f"({emulated:.1f} s with {s.device_ms:g} ms per step of emulated accelerator time), "
        f"{tokens:,} tokens")
    return {"config": "c", "label": "single process, 4x batch", "eval_loss": end_loss,
            "eval_loss_start": start_loss, "train_loss": float(loss.detach()),
            "wall_s": round(emulated, 2), "compute_s": round(wall, 2), "steps": s.steps,
            "batch": LEARNERS * per_learner_batch, "tokens": tokens,
            "threads": s.baseline_threads}


def pair(text: str) -> tuple[float, float]:
    lr, _, momentum = text.partition(",")
    try:
        return float(lr), float(momentum)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LR,MOMENTUM, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny model, 150 steps (about a minute)")
    parser.add_argument("--size", choices=["tiny", "small", "base"],
                        help="lm-stdlib size (default small; tiny with --quick)")
    parser.add_argument("--steps", type=int,
                        help="inner steps per learner at an even split of the token budget "
                             "(default 400; 150 with --quick)")
    parser.add_argument("--sync-every", type=int, default=20, help="H (default 20)")
    parser.add_argument("--fragments", type=int, default=4, help="P (default 4)")
    parser.add_argument("--overlap", type=int, default=2, help="τ (default 2)")
    parser.add_argument("--grace-max", type=float, default=0.5,
                        help="async: policy.grace_max_s (default 0.5)")
    parser.add_argument("--async-outer", type=pair, default=(0.2, 0.0), metavar="LR,MOMENTUM",
                        help="async: outer learning rate and Nesterov momentum "
                             "(default 0.2,0)")
    parser.add_argument("--sync-outer", type=pair, default=(0.7, 0.9), metavar="LR,MOMENTUM",
                        help="sync: outer learning rate and Nesterov momentum "
                             "(default DiLoCo's 0.7,0.9)")
    parser.add_argument("--staleness-exponent", type=float, default=0.5,
                        help="a in (1 + staleness)^-a (default 0.5)")
    parser.add_argument("--device-ms", type=float,
                        help="emulated accelerator time per learner step, slept (default 80; "
                             "10 with --quick)")
    parser.add_argument("--slowdown", type=float, default=3.0,
                        help="the straggler's slowdown (default 3): its emulated accelerator "
                             "time is that many times longer and it is stopped for 1 - 1/that "
                             "of every duty-cycle period")
    parser.add_argument("--period", type=float, default=0.1,
                        help="straggler duty-cycle period in seconds (default 0.1)")
    parser.add_argument("--baseline-threads", type=int, default=2,
                        help="torch threads of the single-process baseline (default 2)")
    parser.add_argument("--only",
                        help="configurations to run, of a,b,b1,c,sa,sb,ai,ai32 (default "
                             "a,b,c,sa,sb: b1, a second sync reference, and ai,ai32, int8 "
                             "with delta pulls against int8 with fp32 pulls, only on "
                             "request, which keeps the full run within 6 minutes)")
    parser.add_argument("--wan", action="store_true",
                        help="also run (wa) async and (wb) sync with every learner behind a "
                             "proxy set to a cross-region link")
    parser.add_argument("--wan-latency-ms", type=float, default=25.0,
                        help="--wan: the link's one-way latency (default 25)")
    parser.add_argument("--wan-mbit", type=float, default=100.0,
                        help="--wan: the link's bandwidth in Mbit/s, each direction "
                             "(default 100)")
    parser.add_argument("--out", type=Path,
                        help="keep event logs and state here (default: a temporary directory)")
    args = parser.parse_args(argv)
    chosen = args.only or ("a,b,c,sa,sb,wa,wb" if args.wan else "a,b,c,sa,sb")
    only = [key.strip() for key in chosen.split(",") if key.strip()]
    unknown = [key for key in only if key not in (*CONFIGS, "c")]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from a, b, b1, c, sa, sb, "
                     f"wa, wb, ai, ai32")
    if args.slowdown < 1:
        parser.error("--slowdown must be at least 1")
    try:
        wan = LinkSpec(latency_ms=args.wan_latency_ms, bandwidth_bytes_s=args.wan_mbit * 1e6 / 8)
    except ValueError as exc:
        parser.error(f"--wan-latency-ms/--wan-mbit: {exc}")

    def interrupted(signum: int, _frame: object) -> None:
        # Unwinds through every `finally`, which stops the learners and the coordinator.
        raise SystemExit(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)
    with tempfile.TemporaryDirectory(prefix="ftsync-bench-convergence-") as tmp:
        s = Settings(
            size=args.size or ("tiny" if args.quick else "small"),
            steps=args.steps or (150 if args.quick else 400),
            sync_every=args.sync_every, fragments=args.fragments, overlap=args.overlap,
            grace_max_s=args.grace_max, async_outer=args.async_outer,
            sync_outer=args.sync_outer, staleness_exponent=args.staleness_exponent,
            device_ms=args.device_ms if args.device_ms is not None else (
                10.0 if args.quick else 80.0),
            slowdown=args.slowdown, period_s=args.period,
            baseline_threads=args.baseline_threads,
            progress_every=1 if args.quick else 2, out=args.out or Path(tmp), wan=wan)
        emit(run(s, only))


def run(s: Settings, only: list[str]) -> dict[str, Any]:
    from learner.tasks import task_named

    tokens_per_step = task_named(TASK, size=s.size).batch_size * (
        task_named(TASK, size=s.size).config.context)  # type: ignore[attr-defined]
    budget = LEARNERS * s.steps * tokens_per_step
    load_before = os.getloadavg()
    log(f"{LEARNERS} learners on {TASK}/{s.size}, budget {budget:,} tokens "
        f"({s.steps} steps x {tokens_per_step} tokens per learner); "
        f"load average {load_before[0]:.2f}")
    results: dict[str, dict[str, Any]] = {}
    began = time.monotonic()
    for key in only:
        results[key] = run_single(s) if key == "c" else run_cluster(CONFIGS[key], s)

    def figure(key: str, name: str) -> Any:
        return results[key][name] if key in results else None

    def ratio(top: Any, bottom: Any) -> float | None:
        return top / bottom if top is not None and bottom else None

    wall_a, wall_b = figure("a", "wall_s"), figure("b", "wall_s")
    wan_wall_ratio = ratio(figure("wb", "wall_s"), figure("wa", "wall_s"))
    wan_loss_ratio = ratio(figure("wa", "eval_loss"), figure("wb", "eval_loss"))
    return {
        "name": "convergence",
        "ratio": ratio(figure("a", "eval_loss"), figure("b", "eval_loss")),
        "target": 1.03,
        "unit": "held-out loss ratio, async / sync (global model, nats per byte)",
        "straggler_ratio": ratio(figure("sb", "wall_s"), figure("sa", "wall_s")),
        "straggler_target": 1.5,
        "straggler_unit": "wall-clock ratio to the token budget, sync / async, one learner "
                          "slowed 3x",
        "loss_a": figure("a", "eval_loss"),
        "loss_b": figure("b", "eval_loss"),
        "loss_c": figure("c", "eval_loss"),
        "loss_b1": figure("b1", "eval_loss"),
        "ratio_vs_averaging": ratio(figure("a", "eval_loss"), figure("b1", "eval_loss")),
        "learner_loss_ratio": ratio(figure("a", "learner_eval_loss_mean"),
                                    figure("b", "learner_eval_loss_mean")),
        "loss_a_vs_c": ratio(figure("a", "eval_loss"), figure("c", "eval_loss")),
        "loss_straggler_a": figure("sa", "eval_loss"),
        "loss_straggler_b": figure("sb", "eval_loss"),
        "wall_a_s": wall_a,
        "wall_b_s": wall_b,
        "wall_c_s": figure("c", "wall_s"),
        "wall_b1_s": figure("b1", "wall_s"),
        "wall_a_faster": wall_a < wall_b if wall_a is not None and wall_b is not None
        else None,
        "wall_straggler_a_s": figure("sa", "wall_s"),
        "wall_straggler_b_s": figure("sb", "wall_s"),
        "wan_wall_ratio": wan_wall_ratio,
        "wan_wall_target": 1.3,
        "wan_loss_ratio": wan_loss_ratio,
        "wan_loss_target": 1.03,
        "wan_unit": "over the cross-region link: wall-clock to the token budget sync / async, "
                    "and held-out loss async / sync",
        "loss_wan_a": figure("wa", "eval_loss"),
        "loss_wan_b": figure("wb", "eval_loss"),
        "wall_wan_a_s": figure("wa", "wall_s"),
        "wall_wan_b_s": figure("wb", "wall_s"),
        "delta_pull_loss_ratio": ratio(figure("ai", "eval_loss"), figure("ai32", "eval_loss")),
        "delta_pull_target": 1.01,
        "delta_pull_unit": "held-out loss, int8 pushes with int8 delta pulls / with fp32 pulls",
        "delta_pull_bytes": {key: {"in": figure(key, "bytes_in"), "out": figure(key, "bytes_out")}
                             for key in ("ai", "ai32") if key in results},
        "settings": {
            "task": TASK, "size": s.size, "learners": LEARNERS,
            "steps_per_learner": s.steps, "tokens_per_learner_step": tokens_per_step,
            "token_budget": budget, "sync_every": s.sync_every, "fragments": s.fragments,
            "overlap": s.overlap, "learner_threads": 1,
            "async": {"min_quorum": 1, "grace_max_s": s.grace_max_s,
                      "outer_lr": s.async_outer[0], "outer_momentum": s.async_outer[1],
                      "staleness_exponent": s.staleness_exponent},
            "sync": {"sync_mode": LEARNERS, "max_staleness": 0, "lockstep": True,
                     "outer_lr": s.sync_outer[0],
                     "outer_momentum": s.sync_outer[1]},
            "sync_averaging": {"sync_mode": LEARNERS, "lockstep": True, "outer_lr": 1.0,
                               "outer_momentum": 0.0},
            "single": {"batch_multiplier": LEARNERS, "threads": s.baseline_threads},
            "wan_link": {"latency_ms": s.wan.latency_ms,
                         "bandwidth_mbit": s.wan.bandwidth_bytes_s * 8 / 1e6},
            "device_ms": s.device_ms,
            "straggler": {"learner": STRAGGLER, "slowdown": s.slowdown,
                          "device_ms": s.device_ms * s.slowdown, "period_s": s.period_s,
                          "stopped_share": round(1 - 1 / s.slowdown, 3)},
        },
        "runs": results,
        "total_s": round(time.monotonic() - began, 1),
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }


def emit(result: dict[str, Any]) -> None:
    """The benchmark's one line of stdout."""
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
