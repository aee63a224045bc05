"""Simulator benchmark: speed at 2.4M chips, and agreement with a real chaos run.

1. Times `experiments/sim/scale.toml` at 2,400,000 chips in M = 16 learners
   over a simulated month (both restarting and elastic learners; the slower
   counts), on one core. Target: <= 60 s.
2. Runs the real chaos experiment `experiments/learner-storm.toml` through
   the harness (`python -m chaos run ... --quiet --out DIR`, about two
   minutes here) and reads its measured goodput from DIR/summary.json.
3. Simulates `experiments/sim/learner-storm.toml` — the same experiment as a
   scenario whose timings were calibrated on earlier runs — and prints the
   gap in goodput points. Target: within ±5 points.
4. As a diagnostic, re-measures the scenario's median timings on this run's
   own events (`chaos.sim.calibrate`; the scenario's background load and
   start-up spread kept: one run pins neither down) and simulates again: the
   gap that is left when the machine's speed during the run is known.

Run from the repository root: `python -m bench.simulator [--out DIR]
[--real-dir DIR]` (`--real-dir` reuses a finished run instead of starting
one). Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos.history import load_events
from chaos.sim import load_scenario, simulate
from chaos.sim.calibrate import calibrate

ROOT = Path(__file__).resolve().parents[1]
SCALE = ROOT / "experiments" / "sim" / "scale.toml"
STORM_SCENARIO = ROOT / "experiments" / "sim" / "learner-storm.toml"
STORM_EXPERIMENT = ROOT / "experiments" / "learner-storm.toml"
LARGE_CHIPS = 2_400_000
LARGE_TARGET_S = 60.0
GAP_TARGET_POINTS = 5.0


def time_large() -> dict[str, Any]:
    scenario = load_scenario(SCALE)
    timings: dict[str, Any] = {}
    for method in ("ftsync:16", "elastic-ftsync:16"):
        started = time.perf_counter()
        result = simulate(scenario.configure(method, LARGE_CHIPS))
        seconds = time.perf_counter() - started
        print(f"  {method} at {LARGE_CHIPS:,} chips, {scenario.duration_s / 86400:.0f} "
              f"simulated days: {seconds:.1f} s ({result.failures:,.0f} failures, "
              f"{result.contributions:,.0f} contributions, {result.events:,} events); "
              f"goodput {result.goodput:.3f}, uptime {result.uptime:.3f}",
              file=sys.stderr, flush=True)
        timings[method] = {"seconds": seconds, "goodput": result.goodput,
                           "uptime": result.uptime, "failures": result.failures,
                           "contributions": result.contributions, "events": result.events}
    return timings


def run_real(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    command = [sys.executable, "-m", "chaos", "run", str(STORM_EXPERIMENT), "--quiet",
               "--out", str(out)]
    print(f"  {' '.join(command[1:])}", file=sys.stderr, flush=True)
    # The run's own checks may fail (exit 1); its goodput is measured all the same.
    subprocess.run(command, cwd=ROOT, check=False, stdout=sys.stderr,
                   env={**os.environ, "PYTHONUNBUFFERED": "1"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-simulator"))
    parser.add_argument("--real-dir", type=Path,
                        help="a finished learner-storm run to compare with (no new run)")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]

    print(f"1. the {LARGE_CHIPS:,}-chip month ({SCALE.relative_to(ROOT)})", file=sys.stderr)
    large = time_large()
    large_s = max(t["seconds"] for t in large.values())

    real_dir = args.real_dir or args.out / "learner-storm"
    print(f"2. the real learner-storm run ({real_dir})", file=sys.stderr, flush=True)
    started = time.monotonic()
    if args.real_dir is None:
        run_real(real_dir)
    real_s = time.monotonic() - started
    summary = json.loads((real_dir / "summary.json").read_text())
    measured = float(summary["goodput"]["value"])
    measured_uptime = float(summary["uptime"]["value"])
    print(f"  measured goodput {measured:.3f}, uptime {measured_uptime:.3f}", file=sys.stderr)

    print(f"3. the scenario ({STORM_SCENARIO.relative_to(ROOT)})", file=sys.stderr)
    scenario = load_scenario(STORM_SCENARIO)
    predicted = simulate(scenario)
    gap = 100 * (predicted.goodput - measured)
    print(f"  simulated goodput {predicted.goodput:.3f} ± {predicted.goodput_sd:.3f} "
          f"(sd over {predicted.replicas} runs), uptime {predicted.uptime:.3f}; "
          f"gap {gap:+.1f} points", file=sys.stderr)

    print("4. the scenario calibrated on this run", file=sys.stderr)
    events = load_events([real_dir / "events.jsonl"])
    cores = scenario.host.cores
    measured_params = calibrate(events, cores=cores, background=scenario.host.background)
    keys = {"step_s": "training.step_s", "finish_s": "training.finish_s",
            "exit_s": "training.exit_s", "startup_s": "failures.startup_s",
            "initial_startup_s": "failures.initial_startup_s",
            "catchup_s": "failures.catchup_s", "push_s": "training.push_s",
            "sync_s": "training.sync_s", "replay_offset_s": "failures.replay_offset_s"}
    overrides = {key: repr(measured_params[name]) for name, key in keys.items()
                 if name in measured_params}
    refit = simulate(load_scenario(STORM_SCENARIO, overrides))
    refit_gap = 100 * (refit.goodput - measured)
    measured_text = ", ".join(f"{k} {v:.3g}" for k, v in measured_params.items())
    print(f"  simulated goodput {refit.goodput:.3f} ± {refit.goodput_sd:.3f}; gap "
          f"{refit_gap:+.1f} points ({measured_text})", file=sys.stderr)

    print(json.dumps({
        "name": "simulator",
        "ratio": predicted.goodput / measured if measured > 0 else float("inf"),
        "target": 1.0,
        "unit": "simulated / measured goodput of learner-storm (target: within ±5 points)",
        "gap_points": gap,
        "gap_target_points": GAP_TARGET_POINTS,
        "large_scenario_s": large_s,
        "large_target_s": LARGE_TARGET_S,
        "large": large,
        "measured_goodput": measured,
        "measured_uptime": measured_uptime,
        "simulated_goodput": predicted.goodput,
        "simulated_goodput_sd": predicted.goodput_sd,
        "simulated_uptime": predicted.uptime,
        "replicas": predicted.replicas,
        "recalibrated_goodput": refit.goodput,
        "recalibrated_gap_points": refit_gap,
        "calibration_this_run": measured_params,
        "real_run_s": real_s,
        "real_run_dir": str(real_dir),
        "load_avg_start": load,
        "load_avg_end": os.getloadavg()[0],
    }), flush=True)


if __name__ == "__main__":
    main()
