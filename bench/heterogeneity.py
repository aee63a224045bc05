"""Heterogeneity sweep in the simulator: the quorum `policy.min_quorum = "auto"`
chooses, and the staleness it gives, as learners' speeds spread and gradients get
noisier, against every static quorum K = 1..4.

The simulator runs the production policy core (its automatic quorum included) and
learner schedule under a simulated clock. It has no loss, so it shows choices, not
convergence (`bench/adaptive.py` measures that with real learners): a
contribution's Σ Δ² comes from a noise model (`training.noise_ratio` ν, each
contribution the gradient plus noise of ν times its square norm), which is what
the automatic quorum measures its noise from. Per setting (speeds × ν) it prints,
for each quorum, the mean quorum the rounds needed and the mean staleness of what
they merged.

`ratio` = over settings, the largest of auto's mean staleness over the default
static quorum's (K = 1, `policy.min_quorum`'s default), the baseline: auto waits
for more learners only where that pays, so it must never be staler (target ≤ 1).
`auto_quorum` lists auto's mean K per setting: it should grow with ν and shrink as
the speeds spread.

Run from the repository root: `python -m bench.heterogeneity`. Progress goes to
stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Literal

from chaos.sim import load_scenario, simulate
from chaos.sim.results import Result
from chaos.sim.scenario import Scenario

SCENARIO = Path(__file__).resolve().parents[1] / "experiments" / "sim" / "heterogeneity.toml"
SPEEDS = {"equal": [1.0, 1.0, 1.0, 1.0], "one-half": [1.0, 1.0, 1.0, 0.5],
          "1-1-½-¼": [1.0, 1.0, 0.5, 0.25], "1-½-¼-⅛": [1.0, 0.5, 0.25, 0.125]}
NOISE = (0.25, 2.0, 16.0)
QUORUMS: tuple[int | Literal["auto"], ...] = (1, 2, 3, 4, "auto")
TARGET = 1.0


def run(scenario: Scenario, speeds: list[float], noise: float,
        quorum: int | Literal["auto"]) -> Result:
    setting = dataclasses.replace(
        scenario,
        cluster=dataclasses.replace(scenario.cluster, learner_speeds=speeds),
        training=dataclasses.replace(scenario.training, noise_ratio=noise),
        policy=dataclasses.replace(scenario.policy, min_quorum=quorum))
    return simulate(setting)


def main() -> None:
    scenario = load_scenario(SCENARIO)
    started = time.perf_counter()
    settings: list[dict[str, Any]] = []
    for label, speeds in SPEEDS.items():
        for noise in NOISE:
            rows: dict[str, dict[str, float]] = {}
            for quorum in QUORUMS:
                result = run(scenario, speeds, noise, quorum)
                rows[str(quorum)] = {"mean_quorum": round(result.mean_quorum, 3),
                                     "mean_staleness": round(result.mean_staleness, 3),
                                     "goodput": round(result.goodput, 4)}
            auto, default = rows["auto"], rows["1"]
            staler = auto["mean_staleness"] / max(default["mean_staleness"], 1e-9)
            settings.append({"speeds": label, "noise_ratio": noise,
                             "staleness_vs_default": round(staler, 4), "quorums": rows})
            static = ", ".join(f"K={k} {rows[k]['mean_staleness']:.2f}"
                               for k in rows if k != "auto")
            print(f"  speeds {label:9} ν = {noise:5g}: auto K̄ {auto['mean_quorum']:.2f} "
                  f"staleness {auto['mean_staleness']:.2f}; static: {static}",
                  file=sys.stderr, flush=True)
    ratio = max(s["staleness_vs_default"] for s in settings)
    print(json.dumps({"name": "heterogeneity", "ratio": round(ratio, 4), "target": TARGET,
                      "unit": "x (auto's mean staleness over static K = 1's, worst setting; "
                              "lower is better)",
                      "met": ratio <= TARGET,
                      "auto_quorum": {f"{s['speeds']} ν={s['noise_ratio']:g}":
                                      s["quorums"]["auto"]["mean_quorum"] for s in settings},
                      "seconds": round(time.perf_counter() - started, 1),
                      "settings": settings}))


if __name__ == "__main__":
    main()
