"""`ftsync-chaos`: local clusters and fault experiments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from chaos.demo import DemoSettings, run_demo
from chaos.session import run_experiment


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ftsync-chaos",
                                     description="Run ftsync clusters through faults.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a chaos experiment file")
    run.add_argument("experiment", type=Path, help="experiment TOML file")
    run.add_argument("--out", type=Path, help="output directory (default runs/NAME)")
    run.add_argument("--quiet", action="store_true", help="no live view")
    demo = sub.add_parser("demo", help="coordinator + synthetic learners through a "
                                       "coordinator crash and restart")
    demo.add_argument("--learners", type=int, default=4)
    demo.add_argument("--task", default="lm-stdlib", choices=["lm-stdlib", "digits", "synthetic"])
    demo.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    demo.add_argument("--steps", type=int, default=600)
    demo.add_argument("--kill-after", type=float, default=15.0,
                      help="seconds before the coordinator is SIGKILLed")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"))
    args = parser.parse_args(argv)
    if args.command == "run":
        sys.exit(run_experiment(args.experiment, args.out, live=not args.quiet))
    if args.learners < 1 or args.steps < 1 or args.kill_after <= 0:
        parser.error("--learners, --steps and --kill-after must be positive")
    sys.exit(run_demo(DemoSettings(learners=args.learners, task=args.task, size=args.size,
                                   steps=args.steps, kill_after_s=args.kill_after,
                                   out=args.out)))
