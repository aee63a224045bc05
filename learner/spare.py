"""Warm spares: a learner process started ahead of need, handed a dead learner's slot.

Most of a restarted learner's time away is its start-up: the interpreter,
`import torch`, the task's data, the model and the optimizer's first step.
`ftsync-learner --spare FLAGS` does all of that before any learner dies (one
training step on a batch it then forgets: the weights and the optimizer's
state are put back, only the warmed code paths stay), says `ftsync-spare:
ready` and waits. Its supervisor — the chaos harness, `ftsync-learner
supervise`, or any orchestrator that keeps a standby — hands it a slot with
one line on its stdin:

    {"args": ["--learner-id", "learner-1", "--shard", "1", "--steps", "480", ...]}

the dead learner's `ftsync-learner` flags (its id, shard and settings). The
spare parses them as `ftsync-learner` would, checks that they build the model
it built (task, size, seed, device, threads, dim), answers `ftsync-spare:
taking the slot of ID` and runs as that learner: it joins, catches up from its
peers or the coordinator and trains. A line it cannot take is answered
`ftsync-spare: refused: WHY` and changes nothing: the spare goes on waiting.
End of input ends a spare that holds no slot (its supervisor is gone).

`Spare` is the supervisor's side of that protocol (one writer of the line,
one reader of the replies); `supervise` is `ftsync-learner supervise --spares
N -- FLAGS`: one learner for users without an orchestrator, replaced by a warm
spare when it dies, with a new spare warming in the background.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

READY = "ftsync-spare: ready"
TAKING = "ftsync-spare: taking the slot of "
REFUSED = "ftsync-spare: refused: "
# Flags that decide the model, the optimizer and the threads the spare built: a slot
# must ask for the same, or the warm state would not be the slot's.
BUILD_FLAGS = ("task", "size", "seed", "device", "threads", "dim")
# A learner that exits so was refused or could not reach the coordinator: a spare
# started with the same flags would fare no better.
FINAL_EXITS = (0, 2, 3)


class HandoverRefused(ValueError):
    """A hand-over line the spare cannot take; the message says why."""


def handover_line(args: list[str]) -> str:
    """The line that hands a slot (its `ftsync-learner` flags) to a spare."""
    return json.dumps({"args": args}) + "\n"


def parse_handover(line: str, spare: argparse.Namespace,
                   parse: Callable[[list[str]], argparse.Namespace]) -> argparse.Namespace:
    """The slot's settings from a hand-over line, checked against what the spare built;
    `parse` reads flags as `ftsync-learner` does and raises `HandoverRefused`."""
    try:
        message = json.loads(line)
    except json.JSONDecodeError as exc:
        raise HandoverRefused(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(message, dict) or set(message) != {"args"}:
        raise HandoverRefused('expected one JSON object {"args": [flag, ...]}')
    flags = message["args"]
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise HandoverRefused('"args" must be a list of strings (ftsync-learner flags)')
    if "--spare" in flags:
        raise HandoverRefused("a slot's flags must not include --spare")
    slot = parse(flags)
    for key in BUILD_FLAGS:
        if getattr(slot, key) != getattr(spare, key):
            raise HandoverRefused(
                f"--{key.replace('_', '-')} {getattr(slot, key)!r} differs from the spare's "
                f"{getattr(spare, key)!r}: the spare built another model")
    return slot


def wait_for_slot(spare: argparse.Namespace, parse: Callable[[list[str]], argparse.Namespace],
                  warmed_s: float, lines: IO[str] = sys.stdin) -> argparse.Namespace | None:
    """Say ready, then read hand-over lines until one is taken; None at end of input."""
    print(f"{READY} ({spare.task}/{spare.size}, warmed in {warmed_s:.2f} s)", flush=True)
    for line in lines:
        if not line.strip():
            continue
        try:
            slot = parse_handover(line, spare, parse)
        except HandoverRefused as exc:
            print(f"{REFUSED}{exc}", flush=True)
            continue
        print(f"{TAKING}{slot.learner_id} (shard {slot.shard})", flush=True)
        return slot
    return None


class Spare:
    """The supervisor's side of one spare process: start it, know when it is warm,
    hand it a slot. Its output goes to `on_line` once it holds a slot (before, to
    the file `log`, if any), and its exit to `on_exit`."""

    def __init__(self, flags: list[str], env: dict[str, str] | None = None,
                 log: Path | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "learner", "--spare", *flags], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**(env if env is not None else os.environ), "PYTHONUNBUFFERED": "1"})
        self.started = time.monotonic()
        self.ready = threading.Event()
        self.refusals: list[str] = []
        self._lock = threading.Lock()
        self._on_line: Callable[[str], None] | None = None
        self._on_exit: Callable[[int], None] | None = None
        self._log = log
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def hand_over(self, args: list[str], on_line: Callable[[str], None],
                  on_exit: Callable[[int], None]) -> None:
        """Give the spare a slot; its output and exit go to the callbacks from now on."""
        assert self.process.stdin is not None
        with self._lock:
            self._on_line, self._on_exit = on_line, on_exit
        self.process.stdin.write(handover_line(args))
        self.process.stdin.flush()

    def stop(self, timeout: float = 10.0) -> None:
        """End a spare that holds no slot (one warming too): SIGTERM, else SIGKILL."""
        if self.process.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.process.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._lock:
                sink = self._on_line
            if line.startswith(READY):
                self.ready.set()
            elif line.startswith(REFUSED):
                self.refusals.append(line[len(REFUSED):].strip())
            if sink is not None:
                sink(line)
            elif self._log is not None:
                with open(self._log, "a") as keep:
                    keep.write(line)
        code = self.process.wait()
        with self._lock:
            done = self._on_exit
        if done is not None:
            done(code)


# -- ftsync-learner supervise -------------------------------------------------------------


def supervise_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftsync-learner supervise",
        description="Run one learner and keep warm spares: when the learner dies, a "
                    "spare takes its slot (id, shard, settings) and a new spare warms.")
    parser.add_argument("--spares", type=int, default=1, help="warm spares to keep (>= 1)")
    parser.add_argument("--max-takeovers", type=int, default=100,
                        help="give up after this many replacements (a learner that "
                             "crashes at once every time)")
    parser.add_argument("flags", nargs=argparse.REMAINDER,
                        help="-- then the learner's ftsync-learner flags")
    return parser


class Supervisor:
    """One learner slot and its spares (the process that `supervise` runs)."""

    def __init__(self, flags: list[str], steps: int, spares: int, max_takeovers: int,
                 out: IO[str] = sys.stdout) -> None:
        self.flags, self.steps, self.max_takeovers = flags, steps, max_takeovers
        self.out = out
        self.step_base = 0
        self.step = 0
        self.takeovers = 0
        self.stopping = False
        self._exited: list[int] = []
        self._changed = threading.Condition()
        self._spares = [Spare(flags) for _ in range(spares)]
        self.learner = subprocess.Popen(
            [sys.executable, "-m", "learner", *flags], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        threading.Thread(target=self._follow, args=(self.learner,), daemon=True).start()

    def _line(self, line: str) -> None:
        from learner.cli import progress_step

        step = progress_step(line)
        if step is not None:
            self.step = self.step_base + step
        self.out.write(line)
        self.out.flush()

    def _exit(self, code: int) -> None:
        with self._changed:
            self._exited.append(code)
            self._changed.notify_all()

    def _follow(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self._line(line)
        self._exit(process.wait())

    def stop(self, signum: int, _frame: object) -> None:
        """A signal to the supervisor ends the learner cleanly, and the spares."""
        with self._changed:
            self.stopping = True
            self._changed.notify_all()
        with contextlib.suppress(ProcessLookupError):
            self.learner.send_signal(signal.SIGTERM)

    def run(self) -> int:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._exited))
                code = self._exited.pop(0)
            if code in FINAL_EXITS or self.stopping or self.takeovers >= self.max_takeovers:
                break
            self._take_over(code)
        for spare in self._spares:
            spare.stop()
        return code

    def _take_over(self, code: int) -> None:
        """Hand the dead learner's slot to the first spare warm (waiting for one), and
        start a new spare in its place."""
        spare = next((s for s in self._spares if s.ready.is_set() and s.alive), None)
        if spare is None:
            spare = min(self._spares, key=lambda s: s.started)
            spare.ready.wait()
        self._spares.remove(spare)
        self._spares.append(Spare(self.flags))
        self.step_base = self.step
        remaining = max(self.steps - self.step, 1)
        self.takeovers += 1
        print(f"ftsync-learner supervise: the learner exited {code} at step {self.step}; "
              f"spare {spare.pid} takes its slot for the {remaining} steps left", file=self.out,
              flush=True)
        spare.hand_over([*self.flags, "--steps", str(remaining)], self._line, self._exit)
        self.learner = spare.process


def supervise(argv: list[str], parse: Callable[[list[str]], argparse.Namespace]) -> int:
    """`ftsync-learner supervise`: its exit code is the last learner's."""
    parser = supervise_parser()
    options = parser.parse_args(argv)
    flags: list[str] = options.flags[1:] if options.flags[:1] == ["--"] else options.flags
    if options.spares < 1 or options.max_takeovers < 1:
        parser.error("--spares and --max-takeovers must be at least 1")
    if not flags:
        parser.error("give the learner's flags after --")
    if "--spare" in flags:
        parser.error("the learner's flags must not include --spare: supervise starts the "
                     "spares")
    try:
        slot = parse(flags)  # a bad flag stops here, before any process starts
    except HandoverRefused as exc:
        parser.error(f"the learner's flags: {exc}")
    supervisor = Supervisor(flags, slot.steps, options.spares, options.max_takeovers)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, supervisor.stop)
    return supervisor.run()

