"""The discrete-event simulator: goodput and uptime at scales no one can rent.

`ftsync-chaos simulate SCENARIO.toml` (or `simulate`/`sweep` from Python)
answers "what goodput and uptime do I get with N chips in M learners, this
failure rate and these settings", for ftsync and for the synchronous and
elastic data-parallel baselines, by running the production policy core
(`coordinator.policy`) and the production learner schedule
(`learner.schedule`) under a simulated clock. The package: `scenario` (TOML
files, examples in `experiments/sim/`), `ftsync` (the ftsync run),
`baselines` (data parallel), `results`, `chips`, `calibrate` (timings from a
real run's events); a run writes `results.json`, `table.md` and PNG curves.

A scenario can replay a chaos experiment's seeded kill timeline
(`failures.replay`), which is how `experiments/sim/learner-storm.toml`
predicts the measured goodput of `experiments/learner-storm.toml`
(`bench/simulator.py` runs both).

    from chaos.sim import load_scenario, simulate, sweep
    scenario = load_scenario("experiments/sim/scale.toml")
    for result in sweep(scenario):
        print(result.label, result.chips, result.goodput, result.uptime)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from chaos.experiment import load_experiment, schedule
from chaos.sim.baselines import data_parallel
from chaos.sim.ftsync import FtsyncRun, Kill
from chaos.sim.results import Result, combine, with_wall
from chaos.sim.scenario import Scenario, load_scenario
from coordinator.config import ConfigError, describe, parse_overrides

__all__ = ["Result", "Scenario", "load_scenario", "main", "replay_kills", "run_once",
           "simulate", "sweep", "table", "write_outputs"]


def run_once(scenario: Scenario, seed: int, kills: Sequence[Kill] | None = None) -> Result:
    """Simulate the scenario's own configuration once with `seed`."""
    started = time.perf_counter()
    if scenario.method == "ftsync":
        result = FtsyncRun(scenario, seed, kills).run()
    elif kills is not None:
        raise ValueError("a replayed kill timeline needs method 'ftsync' (one learner per slot)")
    else:
        result = data_parallel(scenario, seed)
    return with_wall(result, time.perf_counter() - started)


def simulate(scenario: Scenario, seed: int | None = None) -> Result:
    """The scenario's own configuration, averaged over `scenario.replicas` seeds."""
    kills = replay_kills(scenario) if scenario.failures.replay else None
    base = scenario.seed if seed is None else seed
    return combine([run_once(scenario, base + r, kills) for r in range(scenario.replicas)])


def sweep(scenario: Scenario,
          progress: Callable[[Result], None] | None = None) -> list[Result]:
    """Every (method, chips) row of the scenario's sweep (or just the scenario)."""
    results = []
    if not scenario.sweep.chips or not scenario.sweep.methods:
        rows = [scenario]
    else:
        rows = [scenario.configure(method, chips) for method, chips in scenario.rows()]
    for row in rows:
        result = simulate(row)
        results.append(result)
        if progress is not None:
            progress(result)
    return results


def replay_kills(scenario: Scenario) -> list[Kill]:
    """The kill_learner injections of the replayed experiment's seeded timeline,
    on the simulator's clock (from run_start), as (time, learner index)."""
    experiment = load_experiment(scenario.failures.replay)
    ids = experiment.learners.ids()
    if scenario.method != "ftsync" or scenario.cluster.learners != len(ids):
        raise ConfigError(f"failures.replay: {experiment.name} has {len(ids)} learners; the "
                          f"scenario must be method 'ftsync' with cluster.learners = {len(ids)}")
    kills = [fault for fault in experiment.faults if fault.kind == "kill_learner"]
    if any(fault.after_version is not None for fault in kills):
        raise ConfigError(f"failures.replay: {experiment.name}'s kills count from a version "
                          f"(after_version), which the simulator does not know beforehand; "
                          f"replay one whose kills count from the start")
    offset = scenario.failures.replay_offset_s
    return [(action.at_s + offset, ids.index(action.target)) for action in schedule(experiment)
            if action.fault.kind == "kill_learner" and not action.heal]


# -- outputs ---------------------------------------------------------------------------


def table(results: Sequence[Result]) -> str:
    """Markdown: a row per chip count, a column per method, `goodput / uptime`."""
    methods = list(dict.fromkeys(r.label for r in results))
    chips = sorted({r.chips for r in results})
    cell = {(r.label, r.chips): r for r in results}
    lines = ["| chips | " + " | ".join(methods) + " |",
             "| ---: | " + " | ".join("---:" for _ in methods) + " |"]
    for n in chips:
        row = [f"{n:,}"]
        for method in methods:
            r = cell.get((method, n))
            row.append("-" if r is None else f"{r.goodput:.3f} / {r.uptime:.3f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_outputs(scenario: Scenario, results: Sequence[Result], out: Path) -> list[Path]:
    """results.json, table.md and goodput/uptime curves over chips."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "table.md"]
    written[0].write_text(json.dumps(report_json(scenario, results), indent=1) + "\n")
    written[1].write_text(
        f"# {scenario.name}: goodput / uptime\n\n{table(results)}\n")
    for key in ("goodput", "uptime"):
        path = out / f"{key}.png"
        _plot(results, key, path, scenario.name)
        written.append(path)
    return written


def report_json(scenario: Scenario, results: Sequence[Result]) -> dict[str, Any]:
    return {"scenario": scenario.name, "seed": scenario.seed,
            "config": dataclasses.asdict(scenario),
            "results": [r.as_dict() for r in results]}


def _plot(results: Sequence[Result], key: str, path: Path, title: str) -> None:
    fig = Figure(figsize=(8.5, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for method in dict.fromkeys(r.label for r in results):
        rows = sorted((r for r in results if r.label == method), key=lambda r: r.chips)
        ax.plot([r.chips for r in rows], [float(getattr(r, key)) for r in rows],
                marker="o", label=method)
    if len({r.chips for r in results}) > 1:
        ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel(key)
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{title}: {key}")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.savefig(path, dpi=110)


# -- command line ----------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", type=Path, help="scenario TOML file")
    parser.add_argument("--out", type=Path, help="output directory (default runs/sim-NAME)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a scenario key (repeatable)")
    parser.add_argument("--json", action="store_true",
                        help="print the results as one JSON line instead of the table")


def run_command(args: argparse.Namespace) -> int:
    """`ftsync-chaos simulate`: validate, simulate, write outputs, print the table."""
    try:
        scenario = load_scenario(args.scenario, parse_overrides(args.overrides))
        kills = replay_kills(scenario) if scenario.failures.replay else None
    except ConfigError as exc:
        print(f"ftsync-chaos: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(describe(scenario), file=sys.stderr)
        if kills is not None:
            print(f"replaying {len(kills)} kills of {scenario.failures.replay}",
                  file=sys.stderr)
    started = time.perf_counter()

    def progress(r: Result) -> None:
        spread = f" ± {r.goodput_sd:.3f} over {r.replicas} runs" if r.replicas > 1 else ""
        print(f"  {r.label:>18} {r.chips:>10,} chips: goodput {r.goodput:.3f}{spread} "
              f"uptime {r.uptime:.3f} ({r.failures:,.0f} failures, {r.wall_s:.1f} s)",
              file=sys.stderr, flush=True)

    results = sweep(scenario, progress)
    out = args.out or Path("runs") / f"sim-{scenario.name}"
    written = write_outputs(scenario, results, out)
    if args.json:
        print(json.dumps(report_json(scenario, results)))
    else:
        print(table(results))
        print(f"\n{len(results)} configurations in {time.perf_counter() - started:.1f} s; "
              f"wrote {', '.join(str(p) for p in written)}")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ftsync-chaos simulate",
                                     description="Simulate goodput and uptime at scale.")
    add_arguments(parser)
    sys.exit(run_command(parser.parse_args(argv)))
