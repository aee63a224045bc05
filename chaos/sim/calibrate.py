"""Simulator parameters measured from a real chaos run's merged event log.

A scenario that describes a chaos experiment needs the times the simulator
cannot know: how long an inner step takes, how long a restarted learner
takes to start and catch up, how long a push or a commit takes. This module
reads them off `events.jsonl` (`chaos.history` events) as medians, so a
scenario file can say where each of its numbers comes from and
`bench/simulator.py` can show them next to the prediction.

The harness runs every process on one machine, so a wall time depends on how
many learner processes were busy at the moment. Given the machine's `cores`,
`calibrate` also fits the background load (coordinator, harness, proxies)
that makes the step times most consistent across busy counts, and reports
the CPU-time equivalents the simulator's `[host]` model wants.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

from chaos.history import COORDINATOR, HARNESS, Event, learner_ids, run_bounds

# (wall seconds, start, end) of one sample.
_Sample = tuple[float, float, float]
_KEYS = ("step_s", "initial_startup_s", "startup_s", "catchup_s", "finish_s", "exit_s")


def calibrate(*runs: Sequence[Event], cores: float = 0.0,
              background: float | None = None) -> dict[str, float]:
    """Medians (seconds; the mean for step_s) over the samples of one or more
    runs of the quantities a storm-like scenario needs; a key is missing when
    no run has a sample of it. With `cores` > 0 the per-process times are
    converted to seconds of one core, and `startup_sigma` and (unless given;
    one run rarely pins it down) `background` are fitted."""
    pooled: dict[str, list[tuple[float, float, float, int]]] = {}
    intervals = []
    for index, events in enumerate(runs):
        for key, values in _samples(events).items():
            pooled.setdefault(key, []).extend((w, a, b, index) for w, a, b in values)
        intervals.append(_busy_intervals(events))
    result = {key: statistics.median(v[0] for v in values)
              for key, values in pooled.items() if values}
    steps = pooled.get("step_s", [])
    if steps:
        # The mean pace, not the median: 500 steps take 500 mean steps.
        result["step_s"] = statistics.fmean(v[0] for v in steps)
    if cores <= 0 or not steps:
        return result

    def cpu(sample: tuple[float, float, float, int], background: float) -> float:
        wall, a, b, index = sample
        return wall * _speed(intervals[index], a, b, cores, background)

    def spread(background: float) -> float:
        return statistics.pvariance(math.log(cpu(x, background)) for x in steps)

    if background is None:
        background = min((0.05 * i for i in range(81)), key=spread)
    result["background"] = background
    normalized: dict[str, list[float]] = {}
    for key in _KEYS:
        if pooled.get(key):
            normalized[key] = [cpu(x, background) for x in pooled[key]]
            result[key] = (statistics.fmean if key == "step_s" else statistics.median)(
                normalized[key])
    if len(normalized.get("startup_s", [])) >= 2:
        result["startup_sigma"] = statistics.stdev(math.log(x) for x in normalized["startup_s"])
    return result


def _speed(busy: list[tuple[float, float]], a: float, b: float, cores: float,
           background: float) -> float:
    """The average share of a core a learner process had over [a, b]."""
    if b <= a:
        count = sum(1 for lo, hi in busy if lo <= a <= hi)
        return min(1.0, cores / max(count + background, 1e-9))
    # Integrate the share over the pieces between process starts and exits.
    edges = sorted({a, b, *(x for lo, hi in busy for x in (lo, hi) if a < x < b)})
    total = 0.0
    for lo, hi in itertools.pairwise(edges):
        mid = (lo + hi) / 2
        count = sum(1 for s, e in busy if s <= mid <= e)
        total += (hi - lo) * min(1.0, cores / max(count + background, 1e-9))
    return total / (b - a)


def _busy_intervals(events: Sequence[Event]) -> list[tuple[float, float]]:
    """(start, exit) of every learner process the harness ran."""
    _, run_end = run_bounds(events)
    started: dict[object, float] = {}
    intervals = []
    for e in events:
        if e.source != HARNESS or e.kind not in ("process_start", "process_exit"):
            continue
        if e.kind == "process_start" and e.get("role") == "learner":
            started[e.get("pid")] = e.t
        elif e.kind == "process_exit" and e.get("pid") in started:
            intervals.append((started.pop(e.get("pid")), e.t))
    intervals.extend((t, run_end) for t in started.values())
    return intervals


def _samples(events: Sequence[Event]) -> dict[str, list[_Sample]]:
    learners = set(learner_ids(events))
    run_start, _ = run_bounds(events)
    samples: dict[str, list[_Sample]] = {k: [] for k in (
        *_KEYS, "push_s", "sync_s", "replay_offset_s")}
    started: dict[str, float] = {}  # learner -> its current process's start
    first_start: dict[str, float] = {}
    joined: dict[str, float] = {}
    last_train: dict[str, tuple[float, int]] = {}
    left: dict[str, float] = {}
    invoked: dict[tuple[str, int, int], float] = {}

    def add(key: str, start: float, end: float) -> None:
        samples[key].append((end - start, start, end))

    for e in events:
        who = e.source
        if who == HARNESS and e.kind == "process_start" and e.get("role") == "learner":
            name = str(e.get("name"))
            if name not in first_start:
                first_start[name] = e.t
                add("replay_offset_s", run_start, e.t)
            started[name] = e.t
        elif who == HARNESS and e.kind == "process_exit" and str(e.get("name")) in left:
            add("exit_s", left.pop(str(e.get("name"))), e.t)
        elif who in learners and e.kind == "join":
            if who in started:
                first = started[who] == first_start.get(who)
                add("initial_startup_s" if first else "startup_s", started.pop(who), e.t)
            joined[who] = e.t
            last_train.pop(who, None)
        elif who in learners and e.kind == "eval" and e.get("step") == 0 and who in joined:
            add("catchup_s", joined.pop(who), e.t)
        elif who in learners and e.kind == "eval" and who in last_train:
            add("finish_s", last_train[who][0], e.t)
        elif who in learners and e.kind == "train":
            step = e.get("step")
            if isinstance(step, int):
                previous = last_train.get(who)
                if previous is not None and step > previous[1]:
                    wall = (e.t - previous[0]) / (step - previous[1])
                    samples["step_s"].append((wall, previous[0], e.t))
                last_train[who] = (e.t, step)
        elif who == COORDINATOR and e.kind == "leave":
            left[str(e.get("learner"))] = e.t
        elif who == COORDINATOR and e.kind == "commit" and e.has("sync_s"):
            samples["sync_s"].append((e.number("sync_s"), e.t, e.t))
        elif who in learners and e.kind == "push_invoke" and e.has("seq"):
            invoked[(who, e.integer("fragment"), e.integer("seq"))] = e.t
        elif who in learners and e.kind == "push_ack" and e.has("seq"):
            sent = invoked.pop((who, e.integer("fragment"), e.integer("seq")), None)
            if sent is not None:
                add("push_s", sent, e.t)
    return samples
