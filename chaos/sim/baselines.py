"""The data-parallel baselines the simulator sets ftsync against, under the
same failure model: **dp**, one synchronous job on every chip that any failure
stops until it is restarted, and **elastic-dp**, one job that drops a failed
chip and re-forms without it. Every completed step is a commit."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence

import numpy as np

from chaos.metrics import advanced_share
from chaos.sim.chips import Chips
from chaos.sim.results import Result
from chaos.sim.scenario import Scenario


class _Job:
    """Book-keeping of a data-parallel job: work done, steps, failures."""

    def __init__(self, s: Scenario, seed: int) -> None:
        self.s = s
        self.rng = random.Random(seed)
        self.n = s.cluster.chips
        self.chips = Chips(self.n, s.cluster.speed_sigma, self.rng, seed)
        self.slow = self.chips.slowest(0, self.n)
        self.useful = 0.0  # chip-seconds of merged work
        self.useful_steps = 0.0  # chip-steps
        self.failures = 0
        self.events = 0
        self.runs: list[tuple[float, float, float]] = []  # first/last completion, step_s

    def next_failure(self, t: float, active: int) -> float:
        self.events += 1
        return t + self.rng.expovariate(active / self.s.failures.mtbf_chip_s)

    def ran(self, a: float, b: float, active: int, interrupted: bool) -> None:
        """Steps from a to b on `active` chips; a failure at b (`interrupted`)
        loses the step in progress (and with dp, the work since the last
        checkpoint)."""
        step = self.s.training.step_s * self.slow
        done = max(b - a, 0.0) / step
        kept = done
        if interrupted:
            kept = done = float(int(done + 1e-9))
            every_s = self.s.failures.checkpoint_every_s
            if every_s > 0 and self.s.method == "dp":
                every = max(1, math.ceil(every_s / step))
                kept = float(int(done) // every * every)
        self.useful += kept * step * active
        self.useful_steps += kept * active
        if done >= 1:
            self.runs.append((a + step, a + int(done + 1e-9) * step, step))

    def result(self, first_join: float | None, stop: float) -> Result:
        s = self.s
        allocated = self.n * max(stop - first_join, 0.0) if first_join is not None else 0.0
        return Result(
            label=s.label(), method=s.method, chips=self.n, learners=1,
            elastic=s.method == "elastic-dp", min_quorum=1,
            goodput=self.useful / allocated if allocated > 0 else 0.0,
            uptime=_dp_uptime(self.runs, s.uptime_window_s),
            throughput=(self.useful_steps * s.training.step_s / allocated
                        if allocated > 0 else 0.0),
            useful_chip_s=self.useful, allocated_chip_s=allocated, run_s=s.duration_s,
            failures=self.failures,
            commits=float(sum(round((b - a) / step) + 1 for a, b, step in self.runs)),
            events=self.events)


def data_parallel(s: Scenario, seed: int) -> Result:
    """One job on every chip. `dp` stops on any failure until it is restarted
    (start-up and catch-up again, where a failure starts it over); every
    completed step is a commit."""
    if s.method == "elastic-dp":
        return _elastic_data_parallel(s, seed)
    job = _Job(s, seed)
    f, end, n = s.failures, s.duration_s, job.n
    first_join: float | None = None
    stopped_at: float | None = None
    t, startup = 0.0, f.first_startup_s  # a process (re)starts at t
    while t < end:
        stopped_at = None
        fail = job.next_failure(t, n)
        join = t + startup
        begin = join + f.catchup_s
        if first_join is None and join < min(fail, end):
            first_join = join
        if fail < min(begin, end) or begin >= end:
            if fail >= end:
                break
            job.failures += 1  # died starting up or catching up
        else:
            job.ran(begin, min(fail, end), n, interrupted=fail < end)
            if fail >= end:
                break
            job.failures += 1
            chip = job.chips.pick(0, n)
            job.slow = job.chips.renew(chip, job.slow, 0, n) if chip >= 0 else 1.0
        stopped_at = fail
        t, startup = fail + f.restart_s, f.startup_s
    return job.result(first_join, stopped_at if stopped_at is not None else end)


def _elastic_data_parallel(s: Scenario, seed: int) -> Result:
    """One job that drops a failed chip and re-forms without it; a failure
    during a re-form starts the re-form again. A repaired chip (restarted,
    started, caught up) joins again without a pause; chips lost while the job
    starts up are just missing from it."""
    job = _Job(s, seed)
    f, end, n = s.failures, s.duration_s, job.n
    active = n
    repairs: deque[tuple[float, int]] = deque()  # (back at, chip), in order

    def drop(t: float) -> None:
        nonlocal active
        job.failures += 1
        chip = job.chips.pick(0, n)
        job.slow = job.chips.remove(chip, job.slow, 0, n) if chip >= 0 else 1.0
        active -= 1
        repairs.append((t + f.restart_s + f.startup_s + f.catchup_s, chip))

    def rejoin(t: float) -> None:
        nonlocal active
        while repairs and repairs[0][0] <= t:
            _, chip = repairs.popleft()
            active += 1
            job.slow = job.chips.renew(chip, job.slow, 0, n) if chip >= 0 else 1.0

    first_join = f.first_startup_s
    t = first_join + f.catchup_s
    fail = job.next_failure(0.0, active)
    while fail < min(t, end) and active > 1:
        drop(fail)
        fail = job.next_failure(fail, active)
    rejoin(t)
    fail = job.next_failure(t, active)
    while t < end:
        back = repairs[0][0] if repairs else math.inf
        if min(fail, back) >= end:
            job.ran(t, end, active, interrupted=False)
            break
        if back < fail:
            job.ran(t, back, active, interrupted=False)
            t = back
            rejoin(t)
            fail = job.next_failure(t, active)
            continue
        job.ran(t, fail, active, interrupted=True)
        reformed = fail
        while True:  # re-form; a failure before it completes starts it again
            drop(reformed)
            started, reformed = reformed, reformed + f.reform_s
            again = job.next_failure(started, active)
            if again >= reformed or active <= 1:
                break
            reformed = again
        t = reformed
        rejoin(t)
        fail = job.next_failure(t, active)
    return job.result(first_join if first_join < end else None, end)


def _dp_uptime(runs: Sequence[tuple[float, float, float]], window_s: float) -> float:
    """Uptime when every step commits: windows holding a step completion, from
    the first step to the last (chaos.metrics ends the span at the last step)."""
    if not runs:
        return 0.0
    start, end = runs[0][0], runs[-1][1]
    if end <= start:
        return 1.0
    n = math.ceil((end - start) / window_s)
    marks = np.zeros(n + 1, dtype=np.int64)
    singles: list[float] = []
    for a, b, step in runs:
        if step <= window_s:
            lo = min(int((a - start) / window_s), n - 1)
            hi = min(int((b - start) / window_s), n - 1)
            marks[lo] += 1
            marks[hi + 1] -= 1
        else:
            k = 0
            while a + k * step <= b + 1e-9:
                singles.append(a + k * step)
                k += 1
    hit = np.cumsum(marks[:n]) > 0
    if singles:
        index = np.minimum(((np.asarray(singles) - start) / window_s).astype(np.int64), n - 1)
        hit[index] = True
    return advanced_share(hit.tolist(), start, end, window_s)
