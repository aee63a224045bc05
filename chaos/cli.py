"""`ftsync-chaos`: run fault experiments against local clusters, or simulate."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chaos import sim
from chaos.session import run_experiment


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ftsync-chaos",
                                     description="Run ftsync clusters through faults.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a chaos experiment file")
    run.add_argument("experiment", type=Path, help="experiment TOML file")
    run.add_argument("--out", type=Path, help="output directory (default runs/NAME)")
    run.add_argument("--quiet", action="store_true", help="no live view")
    simulate = sub.add_parser("simulate", help="simulate a scenario file at any scale")
    sim.add_arguments(simulate)
    args = parser.parse_args(argv)
    if args.command == "simulate":
        sys.exit(sim.run_command(args))
    sys.exit(run_experiment(args.experiment, args.out, live=not args.quiet))
