"""`ftsync-learner`: run a built-in task as a learner of a coordinator."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import grpc
import numpy as np

from learner.client import Refused, Retry, SynchronizerClient
from learner.streaming import FragmentSync, SyncSettings
from learner.synthetic import RegressionTask, layout_hash
from protos.codec import CodecError, codec_named
from protos.events import EventLog


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        codec_named(args.compression)
        settings = SyncSettings(sync_every=args.sync_every, overlap_steps=args.overlap,
                                alpha=args.alpha)
    except (CodecError, ValueError) as exc:
        sys.exit(f"ftsync-learner: {exc}")
    sys.exit(run_synthetic(args, settings))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftsync-learner",
                                     description="Run an ftsync learner on a built-in task.")
    parser.add_argument("--coordinator", default="127.0.0.1:50051", help="HOST:PORT")
    parser.add_argument("--task", default="synthetic", choices=["synthetic"])
    parser.add_argument("--learner-id", default=f"learner-{os.getpid()}")
    parser.add_argument("--token", default=os.environ.get("FTSYNC_TOKEN"),
                        help="bearer token (or FTSYNC_TOKEN)")
    parser.add_argument("--steps", type=int, default=500, help="inner steps to run")
    parser.add_argument("--sync-every", type=int, default=20, help="H: steps per fragment sync")
    parser.add_argument("--fragments", type=int, default=4, help="P: fragments of the model")
    parser.add_argument("--overlap", type=int, default=2, help="τ: steps before applying")
    parser.add_argument("--alpha", type=float, default=0.0, help="blend of local values kept")
    parser.add_argument("--compression", default="fp32", help="fp32, bf16, int8 or e3m0")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="extra time per step, to stand in for heavier compute")
    parser.add_argument("--dim", type=int, default=1024, help="synthetic: model size")
    parser.add_argument("--shard", type=int, default=0, help="synthetic: data shard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--event-log", default="", help="append JSONL events here")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="seconds to keep retrying an unreachable coordinator")
    parser.add_argument("--progress-every", type=int, default=50, help="steps between lines")
    return parser


def run_synthetic(args: argparse.Namespace, settings: SyncSettings) -> int:
    task = RegressionTask(dim=args.dim, shard=args.shard, seed=args.seed)
    bounds = task.fragment_bounds(args.fragments)
    numels = [b - a for a, b in bounds]
    events = EventLog(args.event_log, source=args.learner_id)
    client = SynchronizerClient(
        args.coordinator, args.learner_id, layout_hash(numels, f"synthetic-{args.dim}"), numels,
        token=args.token, overlap_steps=settings.overlap_steps, codec=args.compression,
        retry=Retry(give_up_after_s=args.connect_timeout), events=events)

    def read(p: int) -> np.ndarray:
        a, b = bounds[p]
        return task.params[a:b].copy()

    def write(p: int, values: np.ndarray) -> None:
        a, b = bounds[p]
        task.params[a:b] = values

    sync = FragmentSync(client, settings, read, write)
    stop = {"signal": ""}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        sync.start(timeout=args.connect_timeout + 30)
    except Refused as refused:
        print(f"ftsync-learner: the coordinator at {args.coordinator} refused "
              f"{args.learner_id}: {refused.details}", file=sys.stderr)
        return 2
    except (grpc.RpcError, TimeoutError) as exc:
        print(f"ftsync-learner: cannot reach a coordinator at {args.coordinator} "
              f"({type(exc).__name__}); is ftsync-coordinator running there?", file=sys.stderr)
        return 3
    start_loss = task.eval_loss()
    started = time.monotonic()
    events.emit("eval", learner=args.learner_id, step=0, loss=start_loss)
    loss = 0.0
    tokens = 0
    for step in range(1, args.steps + 1):
        if stop["signal"]:
            break
        loss, n = task.train_step()
        tokens += n
        if args.step_ms:
            time.sleep(args.step_ms / 1000.0)
        sync.step(n)
        if step % args.progress_every == 0:
            elapsed = time.monotonic() - started
            print(f"{args.learner_id} step {step} loss {loss:.4f} eval {task.eval_loss():.4f} "
                  f"tokens/s {tokens / elapsed:.0f} versions {dict(sync.applied_versions)} "
                  f"backlog {sync.backlog}", flush=True)
    sync.close(reason=stop["signal"] or "done")
    end_loss = task.eval_loss()
    events.emit("eval", learner=args.learner_id, step=sync.local_step, loss=end_loss)
    summary = {
        "learner": args.learner_id, "steps": sync.local_step, "tokens": tokens,
        "eval_loss_start": start_loss, "eval_loss_end": end_loss, "train_loss": loss,
        "merged": client.stats.merged, "dropped": client.stats.dropped,
        "repushed": client.stats.repushed, "unsettled": client.backlog,
        "applied_versions": sync.applied_versions,
        "seconds": round(time.monotonic() - started, 2),
    }
    print(json.dumps(summary), flush=True)
    events.close()
    return 0
