"""A torch learner process for the catch-up tests and benchmark, driven over stdio.

    python -m tests.integration.learner_worker train --coordinator ADDR ...
    python -m tests.integration.learner_worker catchup --coordinator ADDR --peers ADDR ...

`train` starts a `Learner` (serving its fragments with `--serve-peers`, catching
up from `--peers`), prints one JSON line `{"started": ...}` and trains (at most
`--steps` steps, then idles, still serving) until its stdin closes or says
`stop`, then prints `{"steps": [...]}` (the monotonic time each step ended;
CLOCK_MONOTONIC is shared by every process of the host, so the test can compare
it with others' timestamps) and leaves. `catchup` runs `--catch-ups` catch-ups
in a row, each a fresh `Learner` on the same model, and prints one JSON line
per catch-up, with the times the process started, had imported torch and had
built its model; with `--first-step` it takes one training step after the
first and exits.

The model is a handful of embedding tables with sparse gradients and a small
head: many parameters to move, little work per step, so a step's time is the
`--step-ms` it waits (standing in for an accelerator step, during which the
host thread only waits) plus a millisecond or two. On a two-core machine a
CPU-bound step would measure the processes' share of the cores, not whether
serving peers takes anything from the training thread.
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.monotonic()

import argparse  # noqa: E402 (the clock above starts before any import)
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from learner.api import Learner  # noqa: E402

IMPORTED = time.monotonic()
TABLE_DIM = 64


class TableModel(torch.nn.Module):
    """`fragments` embedding tables of `params / fragments` parameters, and a head."""

    def __init__(self, params: int, fragments: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        rows = max(1, params // fragments // TABLE_DIM)
        self.tables = torch.nn.ModuleList(
            torch.nn.Embedding(rows, TABLE_DIM, sparse=True) for _ in range(fragments))
        self.head = torch.nn.Linear(TABLE_DIM, 1)
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        summed = sum((table(ids) for table in self.tables), torch.zeros(()))
        out: torch.Tensor = self.head(summed)
        return out


def make_learner(args: argparse.Namespace, model: TableModel, learner_id: str,
                 peers: list[str]) -> Learner:
    return Learner(args.coordinator, model, sync_every=args.sync_every,
                   fragments=args.fragments, overlap=1, device="cpu", learner_id=learner_id,
                   event_log=args.event_log, peers=peers, serve_peers=args.serve_peers,
                   peer_transport=args.transport, connect_timeout_s=30)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def catch_up_record(learner: Learner, began: float, ended: float) -> dict[str, Any]:
    catch_up = learner.catch_up
    assert catch_up is not None
    return {"began": began, "ended": ended, "seconds": catch_up.seconds,
            "versions": catch_up.versions, "sources": catch_up.sources,
            "bytes_from_peers": catch_up.bytes_from_peers,
            "bytes_from_coordinator": catch_up.bytes_from_coordinator,
            "misses": catch_up.misses[:8]}


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model = TableModel(args.params, args.fragments, args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    learner = make_learner(args, model, args.learner_id, args.peers)
    began = time.monotonic()
    learner.start()
    emit({"started": catch_up_record(learner, began, time.monotonic()),
          "peer_address": learner.peer_address})
    stop = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    generator = torch.Generator().manual_seed(args.seed)
    steps: list[float] = []
    while not stop.is_set() and (not args.steps or len(steps) < args.steps):
        train_step(args, model, optimizer, learner, generator)
        steps.append(time.monotonic())
    stop.wait()
    emit({"steps": steps, "progress": learner.progress()})
    learner.close()


def train_step(args: argparse.Namespace, model: TableModel, optimizer: torch.optim.Optimizer,
               learner: Learner, generator: torch.Generator) -> None:
    ids = torch.randint(0, model.rows, (args.batch,), generator=generator)
    loss = model(ids).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if args.step_ms:
        time.sleep(args.step_ms / 1000.0)
    learner.step(tokens=args.batch)


def catchup(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model = TableModel(args.params, args.fragments, args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(args.seed)
    built = time.monotonic()
    for k in range(args.catch_ups):
        learner = make_learner(args, model, f"{args.learner_id}-{k}", args.peers)
        began = time.monotonic()
        learner.start()
        record = {**catch_up_record(learner, began, time.monotonic()),
                  "process_started": PROCESS_STARTED, "imported": IMPORTED,
                  "model_built": built}
        if args.first_step:
            # The first useful step: its work counts against the versions just loaded.
            train_step(args, model, optimizer, learner, generator)
            emit({**record, "first_step_ended": time.monotonic()})
            # Gone without pushing that step, so the next learner catches up to the
            # same versions.
            os._exit(0)
        emit(record)
        learner.close()
        # A quiet spell after each catch-up, for a baseline interleaved with them.
        time.sleep(args.gap_s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "catchup"])
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--learner-id", default="worker")
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=0, help="train: stop stepping after")
    parser.add_argument("--serve-peers", default=None)
    parser.add_argument("--peers", action="append", default=[])
    parser.add_argument("--transport", default="bulk")
    parser.add_argument("--catch-ups", type=int, default=1)
    parser.add_argument("--gap-s", type=float, default=0.0)
    parser.add_argument("--first-step", action="store_true",
                        help="catchup: take one step after the first catch-up, then exit")
    parser.add_argument("--event-log", default="")
    args = parser.parse_args()
    train(args) if args.mode == "train" else catchup(args)


if __name__ == "__main__":
    main()
