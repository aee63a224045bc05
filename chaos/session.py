"""One chaos run from start to verdict: validate, run, merge, check, report.

This is what `ftsync-chaos run EXPERIMENT.toml` does; the exit code is 0
only when every check passed.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

from rich.console import Console

from chaos.checkers import CheckConfig, run_all
from chaos.experiment import load_experiment
from chaos.failover import audit_check
from chaos.history import load_log, write_events
from chaos.local import StartError
from chaos.report import write_report
from chaos.runner import live_view, run_cluster
from coordinator.config import ConfigError


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _earlier_run(out: Path) -> bool:
    """Whether `out` may be emptied for a new run: it is empty, or a run wrote it
    (every run starts with its harness log). Anything else is the user's."""
    return out.is_dir() and (not any(out.iterdir())
                             or (out / "harness.events.jsonl").is_file())


def run_experiment(path: Path, out: Path | None, live: bool = True) -> int:
    console = Console(soft_wrap=True)
    try:
        experiment = load_experiment(path)
    except ConfigError as exc:
        print(f"ftsync-chaos: {exc}", file=sys.stderr)
        return 2
    if experiment.backend == "docker":
        from chaos.docker import engine_problem

        problem = engine_problem()
        if problem is not None:
            print(f"ftsync-chaos: {problem}", file=sys.stderr)
            return 3
    out = out or Path("runs") / experiment.name
    if out.exists():
        if not _earlier_run(out):
            print(f"ftsync-chaos: {out} exists and does not hold an earlier run's output; "
                  f"give --out a new or empty directory", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    console.print(f"running [bold]{experiment.name}[/bold] ({experiment.learners.count} "
                  f"learners, {len(experiment.faults)} fault specs, seed {experiment.seed}); "
                  f"output in {out}/")
    # A polite kill of the harness stops the cluster as Ctrl-C does. SIGINT too, set
    # here rather than left to Python: a harness started in the background by a shell
    # without job control (a script's `&`, some CI runners) inherits SIGINT ignored,
    # and Python then installs no handler of its own.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        if live:
            display, tick = live_view(console)
            with display:
                run_cluster(experiment, out, tick)
        else:
            run_cluster(experiment, out)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: every process was stopped[/yellow]")
        return 130
    except StartError as exc:
        print(f"ftsync-chaos: the cluster did not start, and what did was stopped: {exc}",
              file=sys.stderr)
        return 3
    log = load_log(sorted(out.glob("*.events.jsonl")))
    events = log.events
    write_events(events, out / "events.jsonl")
    checks = experiment.checks
    results = run_all(events, CheckConfig(
        max_blocked_s=checks.max_blocked_s or None, min_goodput=checks.min_goodput,
        min_uptime=checks.min_uptime, loss_must_drop=checks.loss_must_drop,
        window_s=checks.window_s, max_failover_s=checks.max_failover_s or None))
    if experiment.highly_available:
        results.append(audit_check(out, experiment.coordinator.replicas,
                                   sorted(out.glob("learner-*.events.jsonl"))))
    report = write_report(events, results, out, experiment.name, window_s=checks.window_s,
                          skipped=log.skipped)
    for result in results:
        mark = "[green]PASS[/green]" if result.passed else "[red]FAIL[/red]"
        console.print(f"  {mark} {result.name}: {result.message}")
    passed = all(r.passed for r in results)
    console.print(f"\n{'all checks passed' if passed else 'some checks FAILED'}; "
                  f"report: {report}")
    return 0 if passed else 1
