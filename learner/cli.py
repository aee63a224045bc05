"""`ftsync-learner`: run a built-in task as a learner of a coordinator.

Prints a progress line every few steps (step, loss, tokens/s, the fragment
versions applied, the backlog of contributions not yet merged) and, last,
one JSON summary line. Exit codes: 0 done, 2 refused by the coordinator (or
--serve-peers on an address that cannot be bound), 3 coordinator unreachable.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import numpy as np

from learner.client import Refused, Retry, SynchronizerClient
from learner.peers import TRANSPORTS, PeerSettings
from learner.schedule import DEFAULT_RULE, ApplyRule
from learner.streaming import CatchUp, FragmentSync, SyncSettings
from learner.synthetic import RegressionTask, layout_hash
from protos import discovery, tls
from protos.codec import CodecError, codec_named
from protos.events import EventLog
from protos.settings import number_or_auto

if TYPE_CHECKING:
    import torch

    from learner.tasks import Task

TASK_CHOICES = ("lm-stdlib", "digits", "synthetic")
# A progress line's step and loss (`_Run.line`), as supervisors read them.
PROGRESS = re.compile(r" step (\d+) loss (\S+)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["supervise"]:
        from learner.spare import supervise

        code = supervise(argv[1:], _parse_refusing)
        sys.stdout.flush()
        os._exit(code)
    parser = _parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    if args.check_config:
        print(_describe(parser, args))
        sys.exit(0)
    if args.spare:
        code = run_spare(args)
    else:
        run = run_synthetic if args.task == "synthetic" else run_task
        code = run(args)
    # The run is left and every log flushed. Tearing torch and gRPC down at interpreter
    # exit would keep the process (and the slot it holds) busy for seconds more on a
    # loaded machine, so end here: this is a process's entry point, not a library call.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _RefusingParser(argparse.ArgumentParser):
    """Flags read for a spare's hand-over or a supervisor: a mistake is refused with
    its message instead of ending the process."""

    def error(self, message: str) -> NoReturn:
        from learner.spare import HandoverRefused

        raise HandoverRefused(message)


def _parse_refusing(flags: list[str]) -> argparse.Namespace:
    """Flags checked as `main` checks them; `HandoverRefused` says what is wrong."""
    parser = _parser(_RefusingParser)
    args = parser.parse_args(flags)
    _validate(parser, args)
    return args


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check of the flags that needs no coordinator; `parser.error` on the first."""
    try:
        codec_named(args.compression)
        SyncSettings(sync_every=args.sync_every, overlap_steps=args.overlap, alpha=args.alpha,
                     lockstep=args.lockstep, rule=ApplyRule(args.apply_rule))
        args.peer_settings = PeerSettings(peers=tuple(args.peers), serve=args.serve_peers,
                                          transport=args.peer_transport, insecure=args.insecure)
        args.tls = tls.from_flags(args, insecure=args.insecure)
        args.tls_material = tls.load(args.tls)
        names = args.tls_material.names if args.tls_material else frozenset()
        if names and args.learner_id not in names:
            # Under mutual TLS the coordinator would refuse every call as unauthenticated.
            raise ValueError(f"--tls-cert is issued to {', '.join(sorted(names))}, not to "
                             f"--learner-id {args.learner_id!r}")
        _check_addresses(args.coordinator, args.peers)
    except (CodecError, ValueError) as exc:
        parser.error(str(exc))
    if args.steps < 1 or args.fragments < 1 or not 0 <= args.shard < args.num_shards:
        parser.error("--steps and --fragments must be positive and 0 <= --shard < --num-shards")
    for flag, value, least in (("--progress-every", args.progress_every, 1),
                               ("--threads", args.threads, 1), ("--dim", args.dim, 1),
                               ("--tokens", args.tokens, 0), ("--eval-every", args.eval_every, 0),
                               ("--step-ms", args.step_ms, 0), ("--batch", args.batch, 0)):
        if value < least:
            parser.error(f"{flag} must be at least {least} (got {value})")
    if args.task == "synthetic" and args.fragments > args.dim:
        parser.error(f"--fragments {args.fragments} exceeds --dim {args.dim}: every "
                     f"fragment needs at least one parameter")


def _parser(kind: type[argparse.ArgumentParser] = argparse.ArgumentParser,
            ) -> argparse.ArgumentParser:
    parser = kind(prog="ftsync-learner",
                  description="Run an ftsync learner on a built-in task "
                              "(`ftsync-learner supervise --help`: with warm spares).")
    parser.add_argument("--coordinator", default="127.0.0.1:50051",
                        help="HOST:PORT, a comma-separated list of replicas, or "
                             "etcd://HOST:PORT[,HOST:PORT]/RUN to find the leader in etcd")
    parser.add_argument("--task", default="lm-stdlib", choices=TASK_CHOICES)
    parser.add_argument("--size", default="small", choices=["tiny", "small", "base"],
                        help="model size of lm-stdlib and digits")
    parser.add_argument("--learner-id", default=f"learner-{os.getpid()}")
    parser.add_argument("--token", default=os.environ.get("FTSYNC_TOKEN"),
                        help="bearer token (or FTSYNC_TOKEN)")
    parser.add_argument("--device", default="auto", help="auto (GPU if present), cpu, cuda:N")
    parser.add_argument("--steps", type=int, default=500, help="inner steps to run at most")
    parser.add_argument("--tokens", type=int, default=0, help="stop after this many tokens")
    parser.add_argument("--sync-every", type=number_or_auto("a number of steps"), default=20,
                        help="H: steps per fragment sync, or auto (the coordinator assigns "
                             "each learner its H from its step rate, within policy.h_min "
                             "and policy.h_max)")
    parser.add_argument("--fragments", type=int, default=4, help="P: fragments of the model")
    parser.add_argument("--overlap", type=int, default=2, help="τ: steps before applying")
    parser.add_argument("--alpha", type=float, default=0.0,
                        help="blend of local values kept (with --apply-rule overwrite)")
    parser.add_argument("--apply-rule", choices=[rule.value for rule in ApplyRule],
                        default=DEFAULT_RULE.value,
                        help="what applying a merged version keeps of the steps since the "
                             "push: carry (all of them, on top; the default), overwrite "
                             "(none), boundary (applied at the next due step instead)")
    parser.add_argument("--lockstep", action="store_true",
                        help="wait for each merged fragment when due (synchronous baseline)")
    parser.add_argument("--compression", default="fp32",
                        help="fp32, bf16, int8 or e3m0, for pushes")
    parser.add_argument("--compressed-pulls", action="store_true",
                        help="pull new versions as deltas in the --compression codec (fewer "
                             "bytes; held-out loss 5-9%% worse in BENCHMARKS.md's runs)")
    parser.add_argument("--shard", type=int, default=0, help="this learner's data shard")
    parser.add_argument("--num-shards", type=int, default=1, help="learners sharing the data")
    parser.add_argument("--seed", type=int, default=0, help="model init and data order")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--batch", type=int, default=0,
                        help="examples (sequences) per inner step; 0: the task's size's")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="extra time per step, to stand in for heavier compute")
    parser.add_argument("--dim", type=int, default=1024, help="synthetic: model size")
    parser.add_argument("--peers", type=_addresses, action="extend", default=[],
                        metavar="HOST:PORT[,HOST:PORT...]",
                        help="other learners' peer addresses, to catch up from at start "
                             "(repeatable)")
    parser.add_argument("--serve-peers", default=None, metavar="HOST:PORT",
                        help="serve this learner's fragments to catching-up peers here "
                             "(port 0: any free port, printed at start)")
    parser.add_argument("--peer-transport", default="bulk", choices=TRANSPORTS,
                        help="how to fetch from peers: bulk (raw TCP beside gRPC) or grpc")
    tls.add_flags(parser, "issued to this learner's id: presented to the coordinator, etcd "
                          "and peers, and served to peers",
                  "CA that signs the coordinator's and the peers' certificates (turns TLS "
                  "on); peers then require client certificates")
    parser.add_argument("--insecure", action="store_true",
                        help="serve peers plaintext on a non-loopback --serve-peers address")
    parser.add_argument("--event-log", default="", help="append JSONL events here")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="seconds to keep retrying an unreachable coordinator")
    parser.add_argument("--progress-every", type=int, default=50, help="steps between lines")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="held-out evaluation every N steps (0: start and end only)")
    parser.add_argument("--spare", action="store_true",
                        help="a warm spare: build and warm the task's model, then wait for "
                             "a slot's flags as one JSON line on stdin (learner/spare.py)")
    parser.add_argument("--check-config", action="store_true",
                        help="check every flag and the TLS files, print the settings and exit "
                             "(0 valid, 2 not) without connecting or looking for --device")
    return parser


def _check_addresses(coordinator: str, peers: list[str]) -> None:
    """HOST:PORT each, so that a typo stops the start instead of being retried for
    --connect-timeout as an unreachable coordinator."""
    addresses = (discovery.parse_etcd_url(coordinator)[0] if coordinator.startswith("etcd://")
                 else _addresses(coordinator))
    if not addresses:
        raise ValueError(f"--coordinator {coordinator!r} names no address")
    for address in [*addresses, *peers]:
        if not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}", address):
            raise ValueError(f"{address!r} is not HOST:PORT")


def _describe(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The settings as `flag = value` lines; the token only as set or not."""
    lines = []
    for action in parser._actions:
        if action.dest in ("help", "check_config"):
            continue
        value = getattr(args, action.dest)
        if action.dest == "token":
            value = "<set>" if value else "<none>"
        lines.append(f"{action.option_strings[-1]} = {value!r}")
    return "\n".join(lines)


def _addresses(value: str) -> list[str]:
    return [address.strip() for address in value.split(",") if address.strip()]


def progress_step(line: str) -> int | None:
    """The step a progress line reports, or None for any other line."""
    match = PROGRESS.search(line)
    return int(match.group(1)) if match else None


def _say_caught_up(learner_id: str, catch_up: CatchUp | None,
                   peer_address: str | None) -> None:
    if peer_address:
        print(f"{learner_id}: serving fragments to peers on {peer_address}", flush=True)
    if catch_up is not None:
        peers = sum(1 for source in catch_up.sources.values() if source != "coordinator")
        print(f"{learner_id}: caught up in {catch_up.seconds:.2f}s at versions "
              f"{catch_up.versions} ({peers} of {len(catch_up.sources)} fragments from "
              f"peers)", flush=True)


def _training_ended(run: _Run, events: EventLog) -> None:
    """Logged before the final evaluation and flush: a learner past it is winding
    down, not blocked (the chaos checker `no_learner_blocked` reads it)."""
    events.emit("train_end", learner=run.learner_id, step=run.steps,
                reason=run.stop_signal or "budget")


def _say_leaving(learner_id: str, backlog: int) -> None:
    """Leaving waits for what is not yet merged (a dead coordinator: the whole
    flush timeout), so say so rather than hang silently."""
    if backlog:
        print(f"{learner_id}: leaving; sending the {backlog} contributions not yet merged "
              f"(up to 30 s)", flush=True)


@dataclass
class _Run:
    """What a training loop reports, whichever task it runs."""

    learner_id: str
    started: float = field(default_factory=time.monotonic)
    tokens: int = 0
    steps: int = 0
    loss: float = float("nan")
    eval_start: float = float("nan")
    evals: list[tuple[int, float]] = field(default_factory=list)
    stop_signal: str = ""
    # (time, tokens) at the last progress line: tokens/s is the rate since then.
    _rated: tuple[float, int] = field(default_factory=lambda: (time.monotonic(), 0))

    def line(self, progress: dict[str, Any], eval_loss: float | None) -> str:
        now = time.monotonic()
        rate = (self.tokens - self._rated[1]) / max(now - self._rated[0], 1e-9)
        self._rated = (now, self.tokens)
        held_out = f" eval {eval_loss:.4f}" if eval_loss is not None else ""
        dropped = sum(progress["dropped"].values())
        return (f"{self.learner_id} step {self.steps} loss {self.loss:.4f}{held_out} "
                f"tokens/s {rate:.0f} pushed {progress['pushed']} "
                f"applied {progress['versions']} backlog {progress['backlog']}"
                + (f" dropped {dropped}" if dropped else ""))


def _on_signals(run: _Run) -> None:
    def stop(signum: int, _frame: object) -> None:
        run.stop_signal = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def _start(start: Callable[[], object], joined: Callable[[], bool], run: _Run,
           args: argparse.Namespace) -> int:
    """Join; 0 on success, with the run's signal handlers set, else the exit code
    after saying what to do."""
    interrupted_by = signal.SIGINT

    def interrupt(signum: int, _frame: object) -> None:
        nonlocal interrupted_by
        if joined():
            # Too late to interrupt the join: the run ends cleanly before its first step.
            run.stop_signal = signal.Signals(signum).name
            return
        interrupted_by = signal.Signals(signum)
        raise KeyboardInterrupt

    # SIGTERM too interrupts the join, so that a learner that had joined leaves the run.
    # Either signal, until the run's own handlers are set, finds one of these two.
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # Joining waits up to --connect-timeout for a coordinator: say what it waits for.
        print(f"{args.learner_id}: joining {args.coordinator}", flush=True)
        start()
    except KeyboardInterrupt:
        print(f"ftsync-learner: interrupted ({interrupted_by.name}) while joining "
              f"{args.coordinator}", file=sys.stderr)
        code = 128 + interrupted_by
    except Refused as refused:
        hint = {"unauthenticated": "check --token (or FTSYNC_TOKEN) for this learner id, or "
                                   "that --tls-cert is issued to it",
                "layout_mismatch": "every learner of a run must use the same task, size "
                                   "and --fragments"}.get(refused.reason, "")
        print(f"ftsync-learner: the coordinator at {args.coordinator} refused "
              f"{args.learner_id}: {refused.details}" + (f"\n  {hint}" if hint else ""),
              file=sys.stderr)
        code = 2
    except (grpc.RpcError, TimeoutError) as exc:
        print(f"ftsync-learner: cannot reach a coordinator at {args.coordinator} after "
              f"{args.connect_timeout:.0f}s ({type(exc).__name__}); is ftsync-coordinator "
              f"running there, and is the address right?", file=sys.stderr)
        code = 3
    except OSError as exc:  # --serve-peers on an address in use or not local
        print(f"ftsync-learner: {exc}", file=sys.stderr)
        code = 2
    else:
        _on_signals(run)  # from here on a signal ends the run cleanly, between steps
        return 0
    for sig, handler in previous.items():  # exiting: a signal now only hurries that
        if handler is not None:  # None: one set outside Python, which cannot be restored
            signal.signal(sig, handler)
    return code


def _finish(run: _Run, args: argparse.Namespace, eval_end: float,
            progress: dict[str, Any]) -> int:
    summary = {"learner": args.learner_id, "task": args.task, "steps": run.steps,
               "tokens": run.tokens, "train_loss": run.loss,
               "eval_loss_start": run.eval_start, "eval_loss_end": eval_end,
               "evals": run.evals, "seconds": round(time.monotonic() - run.started, 2),
               "stopped_by": run.stop_signal or None, **progress}
    print(json.dumps(summary), flush=True)
    return 0


@contextlib.contextmanager
def _leaving_on_error(close: Callable[..., None]) -> Iterator[None]:
    """A training loop that fails still leaves the run: the coordinator stops
    counting the learner at once instead of when its lease runs out."""
    try:
        yield
    except BaseException as exc:
        close(reason=f"error: {type(exc).__name__}")
        raise


@dataclass
class _Built:
    """A torch task with its model and inner optimizer, built before the run is joined
    (by a spare, long before)."""

    device: torch.device
    task: Task
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    # Imports torch._dynamo beside the start; the first optimizer step needs it.
    dynamo: threading.Thread


def _build(args: argparse.Namespace) -> _Built:
    """ValueError: --device names no usable device."""
    import torch

    from learner.api import resolve_device
    from learner.tasks import import_dynamo_aside, task_named

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dynamo = import_dynamo_aside()
    task = task_named(args.task, seed=args.seed, device=device, size=args.size,
                      batch_size=args.batch or None)
    model = task.build_model()
    return _Built(device, task, model, task.make_optimizer(model), dynamo)


def _warm(built: _Built, num_shards: int) -> None:
    """One training step and one evaluation on data the spare then forgets: the weights
    and the optimizer's state are put back, the code paths the first real step takes
    (the optimizer's, dynamo's imports) stay warm, and so does every shard's data (read
    once and cached by the task), whichever slot comes."""
    import torch

    saved = {key: value.clone() for key, value in built.model.state_dict().items()}
    batch = next(built.task.train_batches(0, num_shards))
    for shard in range(1, num_shards):
        next(built.task.train_batches(shard, num_shards))
    loss, _ = built.task.loss(built.model, batch)
    built.optimizer.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    built.dynamo.join()
    built.optimizer.step()
    built.optimizer.zero_grad(set_to_none=True)
    built.optimizer.state.clear()
    with torch.no_grad():
        built.model.load_state_dict(saved)
    built.task.eval_loss(built.model)


def run_spare(args: argparse.Namespace) -> int:
    """`--spare`: build and warm what a slot needs, wait for one (learner/spare.py),
    then run as that slot's learner; 0 at end of input without a slot."""
    from learner.spare import wait_for_slot

    began = time.monotonic()
    built = None
    if args.task != "synthetic":
        try:
            built = _build(args)
        except ValueError as exc:
            print(f"ftsync-learner: {exc}", file=sys.stderr)
            return 2
        _warm(built, args.num_shards)
    slot = wait_for_slot(args, _parse_refusing, time.monotonic() - began)
    if slot is None:
        return 0
    return run_synthetic(slot) if built is None else run_task(slot, built, eval_beside=True)


def run_task(args: argparse.Namespace, built: _Built | None = None,
             eval_beside: bool = False) -> int:
    """Train a torch task (`built` already, by a spare); `eval_beside`: the held-out
    loss at start is measured beside the first steps, not before them."""

    from learner.api import Learner

    if built is None:
        try:
            built = _build(args)
        except ValueError as exc:
            print(f"ftsync-learner: {exc}", file=sys.stderr)
            return 2
    device, task, model, optimizer = built.device, built.task, built.model, built.optimizer
    dynamo = built.dynamo
    learner = Learner(args.coordinator, model, sync_every=args.sync_every,
                      fragments=args.fragments, overlap=args.overlap, alpha=args.alpha,
                      lockstep=args.lockstep,
                      compression=args.compression, token=args.token,
                      learner_id=args.learner_id, device=device, event_log=args.event_log,
                      connect_timeout_s=args.connect_timeout, peers=args.peers,
                      serve_peers=args.serve_peers, peer_transport=args.peer_transport,
                      tls=args.tls, compressed_pulls=args.compressed_pulls,
                      apply_rule=args.apply_rule)
    run = _Run(args.learner_id)
    code = _start(learner.start, lambda: learner.catch_up is not None, run, args)
    if code:
        return code
    with _leaving_on_error(learner.close):
        _say_caught_up(args.learner_id, learner.catch_up, learner.peer_address)

        def evaluate_start(weights: torch.nn.Module) -> None:
            run.eval_start = task.eval_loss(weights)
            run.evals.insert(0, (0, run.eval_start))
            learner.events.emit("eval", learner=args.learner_id, step=0, loss=run.eval_start)
            print(f"{args.learner_id}: {args.task}/{args.size} on {device}, "
                  f"{sum(p.numel() for p in model.parameters()):,} parameters in "
                  f"{args.fragments} fragments; held-out loss {run.eval_start:.4f}", flush=True)

        beside = None
        if eval_beside:
            # A spare taking a slot trains at once: the caught-up weights' held-out loss
            # is measured on a copy of them, beside the first steps.
            beside = threading.Thread(target=evaluate_start, args=(copy.deepcopy(model),),
                                      daemon=True)
            beside.start()
        else:
            evaluate_start(model)
        batches = task.train_batches(args.shard, args.num_shards)
        dynamo.join()  # the first optimizer step imports it
        while run.steps < args.steps and not run.stop_signal and (
                not args.tokens or run.tokens < args.tokens):
            loss, tokens = task.loss(model, next(batches))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            if args.step_ms:
                time.sleep(args.step_ms / 1000.0)
            learner.step(tokens)
            run.steps += 1
            run.tokens += tokens
            run.loss = float(loss.detach())
            eval_loss = None
            if args.eval_every and run.steps % args.eval_every == 0:
                eval_loss = task.eval_loss(model)
                run.evals.append((run.steps, eval_loss))
                learner.events.emit("eval", learner=args.learner_id, step=run.steps, loss=eval_loss)
            if run.steps % args.progress_every == 0:
                print(run.line(learner.progress(), eval_loss), flush=True)
            if run.steps % args.progress_every == 0 or run.steps == 1:
                # The first step's event times a start: spawn (or hand-over) to training.
                learner.events.emit("train", learner=args.learner_id, step=run.steps,
                                    loss=run.loss, tokens=run.tokens)
        if beside is not None:
            beside.join()
        _training_ended(run, learner.events)
        eval_end = task.eval_loss(model)
        run.evals.append((run.steps, eval_end))
        learner.events.emit("eval", learner=args.learner_id, step=run.steps, loss=eval_end)
        _say_leaving(args.learner_id, learner.backlog)
        learner.close(reason=run.stop_signal or "done")
    return _finish(run, args, eval_end, learner.progress())


def run_synthetic(args: argparse.Namespace) -> int:
    """The numpy regression task: no torch, for many small learners."""
    task = RegressionTask(dim=args.dim, shard=args.shard, seed=args.seed,
                          batch=args.batch or RegressionTask.batch)
    bounds = task.fragment_bounds(args.fragments)
    numels = [b - a for a, b in bounds]
    events = EventLog(args.event_log, source=args.learner_id)
    client = SynchronizerClient(
        args.coordinator, args.learner_id, layout_hash(numels, f"synthetic-{args.dim}"), numels,
        token=args.token, overlap_steps=args.overlap, codec=args.compression,
        retry=Retry(give_up_after_s=args.connect_timeout), events=events,
        tls=args.tls_material, auto_sync_every=args.sync_every == "auto")

    def read(p: int) -> np.ndarray:
        a, b = bounds[p]
        return task.params[a:b].copy()

    def write(p: int, values: np.ndarray) -> None:
        a, b = bounds[p]
        task.params[a:b] = values

    sync = FragmentSync(client, SyncSettings(sync_every=args.sync_every,
                                             overlap_steps=args.overlap, alpha=args.alpha,
                                             lockstep=args.lockstep,
                                             rule=ApplyRule(args.apply_rule)),
                        read, write, args.peer_settings)
    run = _Run(args.learner_id)
    code = _start(lambda: sync.start(timeout=args.connect_timeout + 30),
                  lambda: sync.catch_up is not None, run, args)
    if code:
        return code
    with _leaving_on_error(sync.close):
        _say_caught_up(args.learner_id, sync.catch_up, sync.peer_address)
        run.eval_start = task.eval_loss()
        events.emit("eval", learner=args.learner_id, step=0, loss=run.eval_start)
        while run.steps < args.steps and not run.stop_signal and (
                not args.tokens or run.tokens < args.tokens):
            run.loss, tokens = task.train_step()
            if args.step_ms:
                time.sleep(args.step_ms / 1000.0)
            sync.step(tokens)
            run.steps += 1
            run.tokens += tokens
            if run.steps % args.progress_every == 0:
                print(run.line(sync.progress(), task.eval_loss()), flush=True)
                events.emit("train", learner=args.learner_id, step=run.steps, loss=run.loss,
                            tokens=run.tokens)
        _training_ended(run, events)
        _say_leaving(args.learner_id, sync.backlog)
        sync.close(reason=run.stop_signal or "done")
    eval_end = task.eval_loss()
    events.emit("eval", learner=args.learner_id, step=run.steps, loss=eval_end)
    events.close()
    return _finish(run, args, eval_end, sync.progress())
