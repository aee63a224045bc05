"""What a simulated run yields: one `Result` per configuration, and `combine`
over the replicas (seeds) of one configuration. `chaos.sim.ftsync` and
`chaos.sim.baselines` make them; `chaos.sim` tabulates and plots them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Result:
    """One configuration's outcome (averaged over its replicas)."""

    label: str
    method: str
    chips: int
    learners: int
    elastic: bool
    # As the policy has it: a number, or "auto" (adapted to the live learners).
    min_quorum: int | Literal["auto"]
    goodput: float
    uptime: float
    # Merged chip-steps at nominal chip speed per allocated chip-second:
    # goodput discounted by waiting on slow chips.
    throughput: float
    useful_chip_s: float
    allocated_chip_s: float
    run_s: float
    failures: float
    commits: float
    contributions: float = 0.0
    merged: float = 0.0
    dropped: dict[str, float] = field(default_factory=dict)
    lost_in_flight: float = 0.0
    # Versions behind of the merged contributions, and the quorum the rounds
    # needed (with min_quorum "auto", what it chose), both means over the run.
    mean_staleness: float = 0.0
    mean_quorum: float = 0.0
    replicas: int = 1
    goodput_sd: float = 0.0
    uptime_sd: float = 0.0
    events: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def combine(results: Sequence[Result]) -> Result:
    """Replicas of one configuration: means (and spreads) of their figures, the
    events and compute time summed."""
    first = results[0]
    n = len(results)

    def mean(key: str) -> float:
        return sum(float(getattr(r, key)) for r in results) / n

    def sd(key: str) -> float:
        if n < 2:
            return 0.0
        mu = mean(key)
        return math.sqrt(sum((float(getattr(r, key)) - mu) ** 2 for r in results) / (n - 1))

    dropped: dict[str, float] = {}
    for r in results:
        for reason, count in r.dropped.items():
            dropped[reason] = dropped.get(reason, 0.0) + count / n
    return Result(
        label=first.label, method=first.method, chips=first.chips, learners=first.learners,
        elastic=first.elastic, min_quorum=first.min_quorum, goodput=mean("goodput"),
        uptime=mean("uptime"), throughput=mean("throughput"),
        useful_chip_s=mean("useful_chip_s"), allocated_chip_s=mean("allocated_chip_s"),
        run_s=mean("run_s"), failures=mean("failures"), commits=mean("commits"),
        contributions=mean("contributions"), merged=mean("merged"), dropped=dropped,
        lost_in_flight=mean("lost_in_flight"), mean_staleness=mean("mean_staleness"),
        mean_quorum=mean("mean_quorum"), replicas=n, goodput_sd=sd("goodput"),
        uptime_sd=sd("uptime"), events=sum(r.events for r in results),
        wall_s=sum(r.wall_s for r in results))


def with_wall(result: Result, wall_s: float) -> Result:
    fields = result.as_dict()
    fields["wall_s"] = wall_s
    return Result(**fields)
