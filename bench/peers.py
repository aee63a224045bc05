"""Side by side with torchft: the same learners, model and faults through torchft's
DiLoCo and through ftsync, in one invocation.

Each system runs three learner processes of one worker (`python -m bench.peers
worker`): the same MLP of about 1M parameters on the same synthetic regression
(a fixed random teacher plus noise), AdamW inner steps, H = `--sync-every`.
torchft: three replica groups of one rank each, `torchft.local_sgd.DiLoCo`
(Nesterov outer SGD, lr 0.7, momentum 0.9), a Lighthouse with min 2 replicas,
Gloo on the CPU. ftsync: a coordinator daemon and three `learner.api.Learner`s
(`--fragments` P, τ = 1, quorum 1, the async outer defaults). P is 1 by default,
so that each learner syncs its whole model every H steps as torchft's DiLoCo
does: the same exchanges, the same bytes. Streaming fragments (P > 1) overlap a
large model's transfer with its steps; at 1M parameters and ~60 steps/s there is
nothing to overlap, and each fragment's push, pull and apply costs CPU the steps
then lack (goodput with no fault 0.65 at P = 4, 0.96 at P = 1, in runs of
different days on the same kind of machine: BENCHMARKS.md). Three scenarios each:
no faults; learner 2 SIGKILLed at `--kill-at` s and restarted at `--restart-at`
s; learner 2 at a third of its speed (it sleeps twice each step's compute).

Goodput is computed the same way for both: useful inner steps over the steps
one learner of the same model computes in the same time with no
synchronization at all, measured in this run right before each scenario (three
such learners side by side, as the systems run three). A step is useful when its
work reached the global model: torchft, the H steps before a sync whose commit
advanced the replica's step by one (a healing replica's jump counts nothing);
ftsync, `c_steps / P` of every contribution in a commit manifest. Allocated:
each slot from its first step to the end of the run, its time down included.

Printed: each system's per-learner step rate against its own no-fault run, the
survivors' longest stall within 10 s of the kill, the restarted learner's time
from its restart to its first merged contribution, goodput, the held-out loss the
learners end at, and ratios ftsync / torchft. ftsync's learners apply with the
learner's default rule, `carry` (`--apply-rule` another: `learner.schedule.ApplyRule`),
and with any rule but the overwrite one more no-fault run is made with the overwrite,
whose held-out loss the rule's is compared with.
Needs the `peers` extra (`pip install -e .[peers]`: torchft 0.2.0).

Run from the repository root: `python -m bench.peers [--duration 40] [--scenarios
no_fault ...] [--apply-rule RULE]`.
Progress goes to stderr; the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from learner.schedule import DEFAULT_RULE, ApplyRule

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = (256, 1024, 640, 64)  # 958,528 weights + biases: about 1M parameters
BATCH = 32
LEARNERS = 3
SYSTEMS = ("torchft", "ftsync")
SCENARIOS = ("no_fault", "kill", "straggler")
SLOW = 2  # the straggler sleeps this many times each step's compute: a third of its speed
TARGETS = {"others_rate_straggler": 0.95, "survivor_stall_s": 0.2, "goodput_no_fault": 0.95,
           "goodput_vs_torchft_min": 1.0, "held_out_loss_vs_overwrite": 1.01}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the worker (one learner process of either system, or of none) --------------------------


def _model_and_data(seed: int) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)  # the same initial weights on every learner
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.GELU()]
    model = nn.Sequential(*layers[:-1])
    teacher = torch.randn(WIDTHS[0], WIDTHS[-1], generator=torch.Generator().manual_seed(1))
    rng = torch.Generator().manual_seed(100 + seed)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(BATCH, WIDTHS[0], generator=rng)
        return x, x @ teacher / WIDTHS[0] ** 0.5 + 0.1 * torch.randn(
            BATCH, WIDTHS[-1], generator=rng)

    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch


def held_out_loss(model: Any) -> float:
    """Mean squared error on 1,024 held-out pairs of the teacher (the same for every
    learner and system): what the run's training reached, beside how fast it stepped."""
    import torch

    teacher = torch.randn(WIDTHS[0], WIDTHS[-1], generator=torch.Generator().manual_seed(1))
    rng = torch.Generator().manual_seed(99)
    x = torch.randn(1024, WIDTHS[0], generator=rng)
    y = x @ teacher / WIDTHS[0] ** 0.5 + 0.1 * torch.randn(1024, WIDTHS[-1], generator=rng)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def _no_commits() -> int:
    return -1


def _nothing() -> None:
    pass


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    model, inner, batch = _model_and_data(args.replica)
    out = open(args.log, "a", buffering=1)  # noqa: SIM115 (lives as long as the process)
    committed: Callable[[], int] = _no_commits
    step_hook: Callable[[], object] = _nothing
    closing: Callable[[], object] = _nothing
    if args.system == "torchft":
        committed, closing = _torchft(args, model, inner)
    elif args.system == "ftsync":
        step_hook, closing = _ftsync(args, model)
    loss_fn = torch.nn.functional.mse_loss
    steps = 0
    # Every learner of a run starts stepping at the same moment, whatever its start-up took.
    time.sleep(max(args.start_at - time.time(), 0))
    deadline = max(args.start_at, time.time()) + args.duration
    while time.time() < deadline:
        began = time.perf_counter()
        x, y = batch()
        loss = loss_fn(model(x), y)
        inner.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        inner.step()  # torchft's DiLoCo syncs in the optimizer's post-step hook
        step_hook()
        steps += 1
        if args.slow:
            time.sleep(SLOW * (time.perf_counter() - began))
        out.write(json.dumps({"t": time.time(), "step": steps, "commit": committed(),
                              "loss": round(float(loss), 5)}) + "\n")
    closing()
    out.close()
    Path(args.log).with_suffix(".held_out.json").write_text(
        json.dumps({"held_out_loss": held_out_loss(model)}))
    os._exit(0)


def _torchft(args: argparse.Namespace, model: Any, inner: Any) -> tuple[Any, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True,  # type: ignore[attr-defined]
                          wait_for_workers=False)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=2,
        use_async_quorum=False, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"replica-{args.replica}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=args.address, hostname="127.0.0.1",
        connect_timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=30),
        timeout=timedelta(seconds=10))
    diloco = DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every)
    diloco.__enter__()

    def close() -> None:
        diloco.__exit__(None, None, None)
        manager.shutdown(wait=False)
        # The replica group's store must serve the other replicas until here: dropped
        # earlier, its server stops and their process groups cannot configure.
        store.set("closed", "1")

    return manager.current_step, close


def _ftsync(args: argparse.Namespace, model: Any) -> tuple[Any, Any]:
    from learner.api import Learner

    learner = Learner(args.address, model, sync_every=args.sync_every, fragments=args.fragments,
                      overlap=1, learner_id=f"learner-{args.replica}", device="cpu",
                      event_log=args.events, connect_timeout_s=60,
                      apply_rule=args.apply_rule)
    learner.start()
    return (lambda: learner.step(BATCH)), (lambda: learner.close())


# -- the runs --------------------------------------------------------------------------------


def start_worker(system: str, replica: int, address: str, out: Path, start_at: float,
                 duration: float, args: argparse.Namespace,
                 slow: bool) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "bench.peers", "worker", "--system", system,
               "--replica", str(replica), "--address", address, "--duration", str(duration),
               "--start-at", str(start_at),
               "--sync-every", str(args.sync_every), "--fragments", str(args.fragments),
               "--apply-rule", args.apply_rule, "--log", str(out / f"w{replica}.jsonl"),
               "--events", str(out / f"learner-{replica}.events.jsonl")]
    if slow:
        command.append("--slow")
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=open(out / f"w{replica}.stderr", "a"),
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "PYTHONUNBUFFERED": "1"})


def run_scenario(system: str, scenario: str, out: Path, args: argparse.Namespace,
                 ) -> dict[str, Any]:
    out.mkdir(parents=True)
    server: Any = None
    if system == "torchft":
        from torchft._torchft import LighthouseServer

        server = LighthouseServer(bind="[::]:0", min_replicas=2)
        address = server.address()
    elif system == "ftsync":
        from chaos.local import CoordinatorProcess

        server = CoordinatorProcess(state_dir=out / "state", args=[
            "--event-log", str(out / "coordinator.events.jsonl"), "--set", "fsync=false",
            "--set", "policy.grace_max_s=0.5", *args.set_flags]).start()
        address = server.address
    else:
        address = ""
    began = time.time() + args.startup_s
    workers = [start_worker(system, i, address, out, began, args.duration, args,
                            slow=scenario == "straggler" and i == LEARNERS - 1)
               for i in range(LEARNERS)]
    killed_at = restarted_at = None
    try:
        if scenario == "kill":
            time.sleep(max(began + args.kill_at - time.time(), 0))  # the scripted schedule
            workers[-1].send_signal(signal.SIGKILL)
            killed_at = time.time()
            workers[-1].wait()
            time.sleep(max(began + args.restart_at - time.time(), 0))
            restarted_at = time.time()
            workers[-1] = start_worker(system, LEARNERS - 1, address, out, restarted_at,
                                       began + args.duration - restarted_at, args,
                                       slow=False)
        for w in workers:
            w.wait(timeout=args.startup_s + args.duration + 120)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        if system == "torchft":
            server.shutdown()
        elif system == "ftsync":
            server.stop()
    return analyse(system, out, began, killed_at, restarted_at, args)


def _steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the last line of a SIGKILLed worker
    return records


def analyse(system: str, out: Path, began: float, killed_at: float | None,
            restarted_at: float | None, args: argparse.Namespace) -> dict[str, Any]:
    per: dict[int, list[dict[str, Any]]] = {i: _steps(out / f"w{i}.jsonl")
                                            for i in range(LEARNERS)}
    end = max((r[-1]["t"] for r in per.values() if r), default=began)
    useful = {i: 0.0 for i in range(LEARNERS)}
    first_merge: float | None = None
    if system == "ftsync":
        useful, first_merge = _ftsync_useful(out, restarted_at, args.fragments)
    elif system == "torchft":
        for i, records in per.items():
            for before, after in itertools.pairwise(records):
                if after["commit"] == before["commit"] + 1:
                    useful[i] += args.sync_every
                    if (restarted_at is not None and i == LEARNERS - 1
                            and after["t"] > restarted_at and first_merge is None):
                        first_merge = after["t"]
    else:
        useful = {i: float(len(records)) for i, records in per.items()}
    # A slot that never stepped (its learner failed to start) was allocated all along.
    allocated = {i: end - (records[0]["t"] if records else began) for i, records in per.items()}
    rates = {i: _rate(records) for i, records in per.items()}
    stall = None
    if killed_at is not None:
        gaps = [b["t"] - a["t"] for i, records in per.items() if i != LEARNERS - 1
                for a, b in itertools.pairwise(records) if killed_at <= b["t"] <= killed_at + 10]
        stall = max(gaps, default=0.0)
    held_out = [json.loads(path.read_text())["held_out_loss"]
                for path in sorted(out.glob("w*.held_out.json"))]
    return {"useful_steps": useful, "allocated_s": allocated, "rates": rates,
            "steps": {i: len(r) for i, r in per.items()},
            # Mean over the learners that ran to the end (a killed one's restart does).
            "held_out_loss": statistics.mean(held_out) if held_out else None,
            "survivor_stall_s": stall,
            "first_merge_after_restart_s": (first_merge - restarted_at
                                            if first_merge and restarted_at else None)}


def _rate(records: list[dict[str, Any]]) -> float:
    """Steps per second over the middle of a worker's run (start-up and end left out)."""
    if len(records) < 10:
        return 0.0
    a, b = records[len(records) // 10], records[-1]
    return float((b["step"] - a["step"]) / max(b["t"] - a["t"], 1e-9))


def _ftsync_useful(out: Path, restarted_at: float | None,
                   fragments: int) -> tuple[dict[int, float], float | None]:
    from chaos.history import load_log
    from chaos.metrics import invocations, merged_ids

    events = load_log(sorted(out.glob("*.events.jsonl"))).events
    merged, invoked = merged_ids(events), invocations(events)
    useful = {i: 0.0 for i in range(LEARNERS)}
    for cid in merged:
        invoke = invoked.get(cid)
        if invoke is not None:
            useful[int(cid.learner_id.rsplit("-", 1)[1])] += invoke.number("c_steps") / fragments
    first = None
    if restarted_at is not None:
        victim = f"learner-{LEARNERS - 1}"
        first = min((e.t for e in events if e.kind == "commit" and e.t > restarted_at
                     and any(c.learner_id == victim and invoked.get(c) is not None
                             and invoked[c].t > restarted_at for c in e.manifest())),
                    default=None)
    return useful, first


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    w.add_argument("--system", choices=[*SYSTEMS, "none"], required=True)
    w.add_argument("--replica", type=int, required=True)
    w.add_argument("--address", default="")
    w.add_argument("--duration", type=float, required=True)
    w.add_argument("--sync-every", type=int, default=20)
    w.add_argument("--fragments", type=int, default=1)
    w.add_argument("--log", required=True)
    w.add_argument("--events", default="")
    w.add_argument("--slow", action="store_true")
    w.add_argument("--start-at", type=float, default=0.0, help="epoch seconds")
    w.add_argument("--apply-rule", default=DEFAULT_RULE.value)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--kill-at", type=float, default=20.0)
    parser.add_argument("--restart-at", type=float, default=25.0)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--fragments", type=int, default=1,
                        help="ftsync's fragments P: each learner pushes one every H/P steps "
                             "(default 1: the whole model every H, as torchft)")
    parser.add_argument("--baseline-s", type=float, default=15.0)
    parser.add_argument("--startup-s", type=float, default=20.0,
                        help="time given every learner to start before all step together")
    parser.add_argument("--apply-rule", choices=[rule.value for rule in ApplyRule],
                        default=DEFAULT_RULE.value,
                        help="what ftsync's learners keep of the steps between a push and "
                             "the apply of its merge (learner.schedule.ApplyRule); with "
                             "another rule than overwrite, an ftsync run with overwrite and no "
                             "faults is the held-out loss's reference")
    parser.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                        help="the scenarios to run (default all three)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of ftsync's coordinator (repeatable; default: the "
                             "daemon's own, outer lr 0.7 without momentum scaled per round)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "worker":
        worker(args)
        return
    if args.fragments < 1:
        parser.error(f"--fragments must be at least 1, got {args.fragments}")
    from chaos.local import setting_flags
    from coordinator.config import ConfigError

    try:
        args.set_flags = setting_flags(args.set)
    except ConfigError as exc:
        parser.error(f"--set: {exc}")
    if "kill" in args.scenarios and not args.kill_at < args.restart_at < args.duration:
        parser.error("need --kill-at < --restart-at < --duration")
    root = args.out or Path(tempfile.mkdtemp(prefix="ftsync-bench-peers-"))
    results: dict[str, dict[str, Any]] = {s: {} for s in SYSTEMS}
    base_rates: dict[str, float] = {}
    for scenario in args.scenarios:
        # The baseline right before each scenario, so that a change in the machine's load
        # reaches it and the two runs it is the yardstick of.
        log(f"no synchronization: {LEARNERS} learners side by side for {args.baseline_s:g} s")
        base = run_scenario("none", "no_fault", root / "baseline" / scenario,
                            argparse.Namespace(**{**vars(args), "duration": args.baseline_s}))
        base_rates[scenario] = base_rate = float(statistics.median(base["rates"].values()))
        log(f"  {base_rate:.1f} steps/s per learner")
        for system in SYSTEMS:
            r = run_scenario(system, scenario, root / system / scenario, args)
            allocated = sum(r["allocated_s"].values())
            r["goodput"] = sum(r["useful_steps"].values()) / (base_rate * allocated) \
                if allocated else 0.0
            results[system][scenario] = r
            log(f"  {system} {scenario}: goodput {r['goodput']:.3f}, rates "
                f"{[round(v, 1) for v in r['rates'].values()]} steps/s, stall "
                f"{r['survivor_stall_s']}, restart -> first merge "
                f"{r['first_merge_after_restart_s']}, held-out loss {r['held_out_loss']}")
    reference = None
    if args.apply_rule != "overwrite" and "no_fault" in args.scenarios:
        log("ftsync no_fault with the overwrite: the held-out loss's reference")
        reference = run_scenario("ftsync", "no_fault", root / "ftsync" / "no_fault-overwrite",
                                 argparse.Namespace(**{**vars(args), "apply_rule": "overwrite"}))
        log(f"  held-out loss {reference['held_out_loss']}")
    summary = {**summarise(results, base_rates, args.scenarios, reference),
               "fragments": args.fragments, "sync_every": args.sync_every,
               "apply_rule": args.apply_rule, "settings": args.set}
    print(json.dumps(summary), flush=True)


def summarise(results: dict[str, dict[str, Any]], base_rates: dict[str, float],
              scenarios: list[str], reference: dict[str, Any] | None = None,
              ) -> dict[str, Any]:
    """The JSON line: the figures of the scenarios that ran (None for one that needs a
    scenario left out); `reference`, an ftsync no-fault run with the overwrite, gives
    the held-out loss ratio of another apply rule."""
    def others_rate(system: str) -> float | None:
        if not {"no_fault", "straggler"} <= set(scenarios):
            return None
        own, slow = results[system]["no_fault"]["rates"], results[system]["straggler"]["rates"]
        return float(statistics.mean(slow[i] / own[i] for i in range(LEARNERS - 1) if own[i]))

    kill = {system: results[system].get("kill", {}) for system in SYSTEMS}
    figures = {system: {
        "goodput": {s: results[system][s]["goodput"] for s in scenarios},
        "held_out_loss": {s: results[system][s]["held_out_loss"] for s in scenarios},
        "others_rate_straggler": others_rate(system),
        "survivor_stall_s": kill[system].get("survivor_stall_s"),
        "first_merge_after_restart_s": kill[system].get("first_merge_after_restart_s"),
    } for system in SYSTEMS}
    ratios = {s: figures["ftsync"]["goodput"][s] / figures["torchft"]["goodput"][s]
              if figures["torchft"]["goodput"][s] else float("inf") for s in scenarios}
    ours = figures["ftsync"]
    loss_ratio = None
    if reference is not None and reference["held_out_loss"]:
        loss_ratio = ours["held_out_loss"]["no_fault"] / reference["held_out_loss"]
    return {
        "name": "peers", "ratio": min(ratios.values()), "target": 1.0,
        "unit": "smallest ftsync / torchft goodput over the scenarios",
        "others_rate_straggler": ours["others_rate_straggler"],
        "survivor_stall_s": ours["survivor_stall_s"],
        "goodput_no_fault": ours["goodput"].get("no_fault"),
        # With another apply rule than the overwrite: its no-fault held-out loss over
        # the overwrite's (target ≤ 1.01).
        "held_out_loss_vs_overwrite": loss_ratio,
        "goodput_vs_torchft_min": min(ratios.values()),
        "goodput_ratios": ratios, "targets": TARGETS, "baseline_steps_per_s": base_rates,
        "ftsync": figures["ftsync"], "torchft": figures["torchft"],
        "runs": results, **({"overwrite_reference": reference} if reference else {}),
    }


if __name__ == "__main__":
    main()
