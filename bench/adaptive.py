"""Adaptive benchmark: static quorums K = 1..4 against `policy.min_quorum = "auto"`,
the same token budget and seeds for every cell, all measured in one run.

Four `ftsync-learner` processes train `--task` (default `lm-stdlib`, `--size tiny`; one
torch thread each, every step sleeping `--step-ms` to stand in for an accelerator, as
in `bench/convergence.py`) through a real `python -m coordinator` at the daemon's outer
defaults (lr 0.7 without momentum, scaled per round), in three settings:

- **heterogeneous**: learners at 1×, 1×, ½× and ¼× speed for the whole run (the
  setting of `experiments/heterogeneous.toml`: SIGSTOP/SIGCONT duty cycles and a
  longer emulated step, as `bench.convergence` slows its straggler), the task's batch;
- **noisy**: four equal learners with an eighth of the task's batch: noisy outer
  gradients;
- **quiet**: four equal learners with four times the task's batch: little noise.

The task is the byte-level language model because its held-out loss still falls at the
end of the budget. `digits` (1,797 images) overfits within it: at four times its batch
the held-out loss of K = 4 bottomed at 0.235 after 2 s of a 7 s run and ended at 0.338,
so "final loss" and "loss at equal wall-clock" measured overfitting, not training speed.

The run starts once every learner has joined and caught up (steps before count for
nothing). The token budget is a total: once the steps summed over the four learners
since then reach
4 × `--steps`, every learner still running is sent SIGTERM. Each learner evaluates the
held-out split every `--eval-every` steps; the run's held-out loss at a time is the mean
of the learners' latest evaluations (before a learner's first, that of the model it
started from). A held-out loss that is not a number (a
diverged learner) counts as infinite.

Each cell runs `--repeats` times (seeds 0, 1, ...; the repeats outermost, so that a
change in the machine's load falls on every K alike; an odd count, so that a median is
one run's figure) and its figures are medians. Per setting, the target is the best
static K's median final loss plus 2%; a run's time is the wall-clock from the first
step to the first moment its loss is at or below the target (a run that never gets
there counts twice its wall-clock; `reached` counts the runs that did), and a cell's
time is the median of its runs'. A single run of 6-10 s moves by a round or two between
runs, more than the 3% the target allows. `auto_rounds_by_quorum` sums the auto runs'
merged rounds by their quorum over the repeats.

`auto_k_vs_best_static` = auto's time to target over the best static K's, in the worst
setting (target ≤ 1.03); `auto_k_best_gain` = over settings, the fastest static K's time
over auto's (target ≥ 1.10 in at least one).

Local steps: on the heterogeneous setting, at the experiment's `min_quorum = "auto"`, every
learner at `--sync-every H` (default 20) against `--sync-every auto` with
`policy.h_max = H` (the fastest keeps H, a learner k times slower gets about H/k).
`auto_h_staleness_ratio` = fixed H's mean staleness of merged contributions over auto's
(target ≥ 2); `auto_h_loss_ratio` = auto's held-out loss over fixed H's at equal
wall-clock, the shorter run's end (target ≤ 1.00); medians over the repeats as well.

Run from the repository root: `python -m bench.adaptive [--quick] [--parts quorum,local_steps]
[--set KEY=VALUE ...]` (`--set`: a coordinator setting for every run). Progress goes to
stderr; the last line of stdout is one JSON object, which also records the task, its
size and batch, and the `--set` settings.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bench.convergence import DutyCycle, log
from chaos.local import CoordinatorProcess, setting_flags
from coordinator.config import ConfigError
from learner.tasks import SIZES, TASKS, task_named

LEARNERS = 4
QUORUMS: tuple[int | str, ...] = (1, 2, 3, 4, "auto")
# `ftsync-learner`'s progress line: its step, and its held-out loss when it evaluated.
PROGRESS = re.compile(r"^\S+ step (\d+) .*? eval (\S+)")
# Its line before the first step: the caught-up model's held-out loss.
READY = re.compile(r"held-out loss (\S+)")
RUN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Setting:
    name: str
    # The learners' batch over the task's own.
    batch_scale: float
    # Per learner: how many times slower than the fastest.
    slowdowns: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)

    def batch(self, task_batch: int) -> int:
        return max(1, round(task_batch * self.batch_scale))


SETTINGS = (Setting("heterogeneous", 1.0, (1.0, 1.0, 2.0, 4.0)),
            Setting("noisy", 1 / 8), Setting("quiet", 4.0))


@dataclass
class Run:
    """One cluster run: the held-out loss curve (seconds from the first step, loss)."""

    setting: str
    quorum: int | str
    curve: list[tuple[float, float]] = field(default_factory=list)
    wall_s: float = 0.0
    rounds: dict[int, int] = field(default_factory=dict)
    mean_staleness: float = 0.0
    # With sync_every "auto": each learner's H as last assigned.
    assigned: dict[str, int] = field(default_factory=dict)

    @property
    def final(self) -> float:
        return self.curve[-1][1]

    def time_to(self, target: float) -> tuple[float, bool]:
        """Seconds to `target`, and whether it got there: a run that did not counts
        twice its wall-clock, so that it never looks faster than one that did."""
        for at, loss in self.curve:
            if loss <= target:
                return at, True
        return 2 * self.wall_s, False

    def loss_at(self, at: float) -> float:
        """The held-out loss at `at` seconds: the last evaluation by then."""
        before = [loss for t, loss in self.curve if t <= at]
        return before[-1] if before else self.curve[0][1]


class Followed:
    """Reads learners' progress lines: steps since the start, latest eval per learner.

    The run starts when every learner has said it is about to train (its "held-out
    loss" line, after join and catch-up): on a loaded machine their start-ups differ
    by tens of seconds. Steps taken before that count toward nothing. (Holding the
    early ones with SIGSTOP instead can freeze one while its initial values are
    still on their way, and the others wait for them.)"""

    def __init__(self, count: int) -> None:
        self.steps = [0] * count
        self.before = [0] * count
        self.evals: list[float | None] = [None] * count
        self.ready = [threading.Event() for _ in range(count)]
        self.curve: list[tuple[float, float]] = []
        self.started: float | None = None
        self.lock = threading.Lock()

    def follow(self, index: int, process: subprocess.Popen[str]) -> threading.Thread:
        stream: IO[str] | None = process.stdout
        assert stream is not None

        def read() -> None:
            for line in stream:
                ready = READY.search(line)
                if ready:
                    with self.lock:
                        self.evals[index] = held_out(ready.group(1))
                    self.ready[index].set()
                match = PROGRESS.match(line)
                if match:
                    self.saw(index, int(match.group(1)), held_out(match.group(2)))
        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return thread

    def go(self, timeout: float) -> None:
        """Wait for every learner to be ready to train, then start the run."""
        deadline = time.monotonic() + timeout
        for i, event in enumerate(self.ready):
            if not event.wait(max(deadline - time.monotonic(), 0.0)):
                raise RuntimeError(f"learner-{i} did not get ready to train in time")
        with self.lock:
            self.started = time.monotonic()
            self.before = list(self.steps)
            self.steps = [0] * len(self.steps)

    def saw(self, index: int, step: int, loss: float) -> None:
        now = time.monotonic()
        with self.lock:
            if self.started is None:
                self.steps[index] = step
                self.evals[index] = loss
                return
            self.steps[index] = step - self.before[index]
            self.evals[index] = loss
            known = [e for e in self.evals if e is not None]
            if len(known) == len(self.evals):
                self.curve.append((now - self.started, sum(known) / len(known)))


def held_out(said: str) -> float:
    """A learner's printed held-out loss; `nan` (it diverged) counts as infinite, so
    that such a run never reaches a target and never has the lowest final loss."""
    loss = float(said)
    return math.inf if math.isnan(loss) else loss


def run_cluster(setting: Setting, quorum: int | str, args: argparse.Namespace,
                sync_every: int | str | None = None, seed: int = 0) -> Run:
    """One run; `sync_every` None: the learners' default H."""
    with tempfile.TemporaryDirectory(prefix="ftsync-adaptive-") as tmp:
        events = Path(tmp) / "events.jsonl"
        local_steps = [] if sync_every is None else ["--sync-every", str(sync_every)]
        coordinator = CoordinatorProcess(Path(tmp) / "state", [
            "--min-quorum", str(quorum), "--set", f"policy.grace_max_s={args.grace_max_s}",
            "--set", "policy.max_staleness=32", "--set", "fsync=false",
            "--set", f"policy.h_max={args.sync_every}", "--set", "policy.h_min=2",
            *args.set_flags,
            "--event-log", str(events)]).start()
        followed = Followed(LEARNERS)
        stderr = open(Path(tmp) / "learners.stderr", "w")  # noqa: SIM115 (closed below)
        processes: list[subprocess.Popen[str]] = []
        cycles: list[DutyCycle] = []
        try:
            for i, slowdown in enumerate(setting.slowdowns):
                process = subprocess.Popen(
                    [sys.executable, "-m", "learner", "--coordinator", coordinator.address,
                     "--task", args.task, "--size", args.size, "--learner-id", f"learner-{i}",
                     "--shard", str(i), "--num-shards", str(LEARNERS), "--seed", str(seed),
                     "--batch", str(setting.batch(args.task_batch)),
                     "--steps", str(args.steps * 4),
                     "--step-ms", str(args.step_ms * slowdown),
                     "--progress-every", str(args.eval_every),
                     "--eval-every", str(args.eval_every), *local_steps],
                    stdout=subprocess.PIPE, stderr=stderr, text=True)
                followed.follow(i, process)
                processes.append(process)
            followed.go(RUN_TIMEOUT_S)
            cycles += [DutyCycle(p.pid, 0.1, slowdown).start()
                       for p, slowdown in zip(processes, setting.slowdowns, strict=True)
                       if slowdown > 1]
            deadline = time.monotonic() + RUN_TIMEOUT_S
            told = time.monotonic()
            while sum(followed.steps) < args.steps * LEARNERS:
                if time.monotonic() > deadline or all(p.poll() is not None for p in processes):
                    break
                if time.monotonic() - told > 10:
                    told = time.monotonic()
                    log(f"  steps {followed.steps}")
                time.sleep(0.05)
            wall = time.monotonic() - (followed.started or time.monotonic())
        finally:
            for cycle in cycles:
                cycle.stop()
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            for process in processes:
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            coordinator.stop()
            stderr.close()
        said = (Path(tmp) / "learners.stderr").read_text()
        run = Run(setting.name, quorum, list(followed.curve), wall)
        logged = [json.loads(line) for line in events.read_text().splitlines()]
        run.assigned = {e["learner"]: e["sync_every"] for e in logged
                        if e.get("kind") == "sync_every"}
        merged = [e for e in logged if e.get("kind") == "commit"]
        staleness = [c["staleness"] for e in merged for c in e["manifest"]]
        for e in merged:
            run.rounds[e["quorum"]] = run.rounds.get(e["quorum"], 0) + 1
        run.mean_staleness = sum(staleness) / len(staleness) if staleness else 0.0
        if not run.curve:
            raise RuntimeError(f"{setting.name} K={quorum}: no held-out evaluation came back; "
                               f"the learners said: {said[-2000:]}")
        return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 60 steps, K=1,auto")
    parser.add_argument("--steps", type=int, default=300, help="budget per learner")
    parser.add_argument("--step-ms", type=float, default=20.0, help="emulated device time")
    parser.add_argument("--task", default="lm-stdlib", choices=TASKS,
                        help="the learners' built-in task")
    parser.add_argument("--size", default="tiny", choices=SIZES, help="the task's model size")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--grace-max-s", type=float, default=0.5)
    parser.add_argument("--sync-every", type=int, default=20,
                        help="the fixed H, and policy.h_max of the auto runs")
    parser.add_argument("--only", default="", help="settings to run, comma-separated")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs per cell, seeds 0.., an odd count (figures are medians; "
                             "default 3, 1 with --quick)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a coordinator setting for every run (repeatable)")
    parser.add_argument("--parts", default="quorum,local_steps",
                        help="quorum (static K against auto), local_steps (fixed H against "
                             "auto on the heterogeneous setting), comma-separated")
    args = parser.parse_args(argv)
    quorums = QUORUMS
    if args.quick:
        args.steps, quorums = 60, (1, "auto")
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1 or args.repeats % 2 == 0:
        parser.error(f"--repeats must be odd and at least 1, so that a median is one run's "
                     f"figure (got {args.repeats})")
    try:
        args.set_flags = setting_flags(args.set)
    except ConfigError as exc:
        parser.error(f"--set: {exc}")
    args.task_batch = task_named(args.task, size=args.size).batch_size
    parts = set(args.parts.split(","))
    if parts - {"quorum", "local_steps"}:
        parser.error(f"--parts takes quorum and local_steps; unknown: "
                     f"{', '.join(sorted(parts - {'quorum', 'local_steps'}))}")
    names = {s.name for s in SETTINGS}
    only = set(args.only.split(",")) if args.only else names
    if only - names:
        parser.error(f"--only takes {', '.join(s.name for s in SETTINGS)}; unknown: "
                     f"{', '.join(sorted(only - names))}")
    settings = [s for s in SETTINGS if s.name in only]
    result: dict[str, Any] = {
        "name": "adaptive", "target": 1.03,
        "unit": "auto quorum's time to target / best static quorum's (worst setting)",
        "steps_per_learner": args.steps, "repeats": args.repeats, "task": args.task,
        "size": args.size, "task_batch": args.task_batch, "settings": args.set}
    if "quorum" in parts:
        result.update(compare_quorums(settings, quorums, args))
    if "local_steps" in parts:
        result.update(compare_local_steps(args))
    print(json.dumps(result))


def compare_quorums(settings: list[Setting], quorums: tuple[int | str, ...],
                    args: argparse.Namespace) -> dict[str, Any]:
    """Static K against auto in each setting: median time to the best static K's
    median final loss + 2%, over `args.repeats` seeds."""
    scenarios: dict[str, Any] = {}
    ratios, gains = [], []
    for setting in settings:
        runs: dict[int | str, list[Run]] = {quorum: [] for quorum in quorums}
        for seed in range(args.repeats):
            for quorum in quorums:
                log(f"{setting.name}: K={quorum} seed {seed}")
                r = run_cluster(setting, quorum, args, seed=seed)
                runs[quorum].append(r)
                log(f"  wall {r.wall_s:.1f}s final {r.final:.4f} "
                    f"staleness {r.mean_staleness:.2f} rounds by quorum {r.rounds}")
        finals = {k: statistics.median(r.final for r in rs) for k, rs in runs.items()}
        target = min(f for k, f in finals.items() if k != "auto") * 1.02
        each = {k: [r.time_to(target) for r in rs] for k, rs in runs.items()}
        times = {k: statistics.median(t for t, _ in ts) for k, ts in each.items()}
        best_static = min(t for k, t in times.items() if k != "auto")
        ratios.append(times["auto"] / best_static)
        gains.append(best_static / times["auto"])
        auto_rounds: dict[int, int] = {}
        for r in runs["auto"]:
            for k, n in r.rounds.items():
                auto_rounds[k] = auto_rounds.get(k, 0) + n
        scenarios[setting.name] = {
            "target": round(target, 4),
            "time_to_target_s": {str(k): round(t, 2) for k, t in times.items()},
            "time_to_target_each_s": {str(k): [round(t, 2) for t, _ in ts]
                                      for k, ts in each.items()},
            "reached": {str(k): sum(ok for _, ok in ts) for k, ts in each.items()},
            "final_loss": {str(k): round(f, 4) for k, f in finals.items()},
            "mean_staleness": {str(k): round(statistics.median(r.mean_staleness for r in rs), 3)
                               for k, rs in runs.items()},
            "auto_rounds_by_quorum": auto_rounds,
        }
    return {"ratio": round(max(ratios), 3), "auto_k_vs_best_static": round(max(ratios), 3),
            "auto_k_best_gain": round(max(gains), 3), "scenarios": scenarios}


def compare_local_steps(args: argparse.Namespace) -> dict[str, Any]:
    """Fixed H against `--sync-every auto` on the heterogeneous setting, at the
    experiment's automatic quorum: staleness, and held-out loss at equal wall-clock
    (each seed's pair compared at the shorter run's end; medians over the seeds)."""
    setting = SETTINGS[0]
    pairs = []
    for seed in range(args.repeats):
        pair = {}
        for sync_every in (args.sync_every, "auto"):
            log(f"{setting.name}: H={sync_every} seed {seed}")
            pair[sync_every] = r = run_cluster(setting, "auto", args, sync_every, seed)
            log(f"  wall {r.wall_s:.1f}s final {r.final:.4f} staleness {r.mean_staleness:.2f} "
                f"rounds by quorum {r.rounds} assigned {r.assigned}")
        pairs.append((pair[args.sync_every], pair["auto"]))
    at = [min(fixed.wall_s, auto.wall_s) for fixed, auto in pairs]
    losses = [(fixed.loss_at(t), auto.loss_at(t)) for (fixed, auto), t in zip(pairs, at,
                                                                              strict=True)]
    staleness = {"fixed": statistics.median(fixed.mean_staleness for fixed, _ in pairs),
                 "auto": statistics.median(auto.mean_staleness for _, auto in pairs)}
    return {
        "auto_h_staleness_ratio": round(staleness["fixed"] / max(staleness["auto"], 1e-9), 3),
        "auto_h_loss_ratio": round(statistics.median(a / f for f, a in losses), 4),
        "local_steps": {
            "fixed_h": args.sync_every,
            "equal_wall_clock_s": [round(t, 2) for t in at],
            "loss_at_equal_wall_clock": {"fixed": [round(f, 4) for f, _ in losses],
                                         "auto": [round(a, 4) for _, a in losses]},
            "mean_staleness": {k: round(v, 3) for k, v in staleness.items()},
            "rounds_by_quorum": {"fixed": [fixed.rounds for fixed, _ in pairs],
                                 "auto": [auto.rounds for _, auto in pairs]},
            "assigned": [auto.assigned for _, auto in pairs]},
    }


if __name__ == "__main__":
    main()
