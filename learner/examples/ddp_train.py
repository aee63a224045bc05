"""A `torchrun` job as one ftsync learner: DDP inside, rank 0 talks to the synchronizer.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m learner.examples.ddp_train --coordinator 127.0.0.1:50051 --steps 300

Every rank trains a small MLP on its own shard of a synthetic teacher-student
regression (the teacher is a fixed random MLP); gradients are averaged by
DDP (gloo on CPU, nccl with `--device cuda`), and the model's fragments go
through a `DistributedLearner`. Rank 0 prints progress lines and a final
JSON summary with the held-out loss at start and end; every rank prints a
JSON line with a checksum of its parameters, which must all agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from learner.client import Refused
from learner.distributed import DistributedError, DistributedLearner

IN_FEATURES = 32


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.Tanh(),
                         nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))


class Regression:
    """y = teacher(x) + noise, x ~ N(0, I); each rank draws from its own stream."""

    def __init__(self, seed: int, rank: int, device: torch.device) -> None:
        self.device = device
        torch.manual_seed(seed + 10_000)
        self.teacher = mlp(64).to(device).requires_grad_(False)
        self.data = torch.Generator().manual_seed(seed * 1000 + rank + 1)
        held_out = torch.Generator().manual_seed(seed * 1000)
        self.eval_x = torch.randn(2048, IN_FEATURES, generator=held_out).to(device)
        self.eval_y = self.teacher(self.eval_x)

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(size, IN_FEATURES, generator=self.data)
        noise = 0.01 * torch.randn(size, 1, generator=self.data)
        x = x.to(self.device)
        return x, self.teacher(x) + noise.to(self.device)

    def eval_loss(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.mse_loss(model(self.eval_x), self.eval_y))


def checksum(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=args.collective_timeout))
    try:
        return train(args, device)
    finally:
        dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc-per-node N -m learner.examples.ddp_train",
        description="Train a small MLP with DDP inside one ftsync learner.")
    parser.add_argument("--coordinator", default="127.0.0.1:50051", help="HOST:PORT")
    parser.add_argument("--steps", type=int, default=300, help="inner steps to run")
    parser.add_argument("--batch", type=int, default=64, help="examples per rank per step")
    parser.add_argument("--hidden", type=int, default=64, help="MLP width")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    parser.add_argument("--sync-every", type=int, default=20, help="H: steps per fragment sync")
    parser.add_argument("--fragments", type=int, default=3, help="P: fragments of the model")
    parser.add_argument("--overlap", type=int, default=2, help="τ: steps before applying")
    parser.add_argument("--compression", default="fp32", help="fp32, bf16, int8 or e3m0")
    parser.add_argument("--learner-id", default=None, help="default: HOST-PID of rank 0")
    parser.add_argument("--token", default=os.environ.get("FTSYNC_TOKEN"),
                        help="bearer token (or FTSYNC_TOKEN)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per rank (LOCAL_RANK), nccl")
    parser.add_argument("--event-log", default="", help="rank 0 appends JSONL events here")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="seconds rank 0 keeps retrying an unreachable coordinator")
    parser.add_argument("--collective-timeout", type=float, default=300.0,
                        help="seconds a rank waits on the others before giving up")
    parser.add_argument("--progress-every", type=int, default=50, help="steps between lines")
    return parser


def train(args: argparse.Namespace, device: torch.device) -> int:
    rank = dist.get_rank()
    task = Regression(args.seed, rank, device)
    torch.manual_seed(args.seed)
    model = mlp(args.hidden).to(device)
    learner = DistributedLearner(
        args.coordinator, model, sync_every=args.sync_every, fragments=args.fragments,
        overlap=args.overlap, compression=args.compression, token=args.token,
        learner_id=args.learner_id, event_log=args.event_log,
        connect_timeout_s=args.connect_timeout,
        tokens_per_step=args.batch)  # a fixed count: no per-step all-reduce of tokens
    try:
        learner.start()
    except DistributedError as exc:
        print(f"ddp_train rank {rank}: {exc}", file=sys.stderr)
        return 3
    except Refused as refused:
        print(f"ddp_train: the coordinator at {args.coordinator} refused this job: "
              f"{refused.details}", file=sys.stderr)
        return 2
    except (grpc.RpcError, TimeoutError) as exc:
        print(f"ddp_train: cannot reach a coordinator at {args.coordinator} "
              f"({type(exc).__name__}); is ftsync-coordinator running there?", file=sys.stderr)
        return 3
    # DDP after start: the model already holds the global values on every rank.
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start_loss = task.eval_loss(model)
    started = time.monotonic()
    applied = 0
    loss = 0.0
    with learner:  # already started: closes it (rank 0 leaves) however the loop ends
        for step in range(1, args.steps + 1):
            x, y = task.batch(args.batch)
            train_loss = nn.functional.mse_loss(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            train_loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            applied += len(learner.step())
            loss = train_loss.item()
            if rank == 0 and step % args.progress_every == 0:
                elapsed = time.monotonic() - started
                say(f"step {step} loss {loss:.4f} eval {task.eval_loss(model):.4f} "
                    f"steps/s {step / elapsed:.0f} versions {learner.applied_versions} "
                    f"backlog {learner.backlog}")
        say(json.dumps({"rank": rank, "params_sha256": checksum(model)}))
        if rank == 0:
            progress = learner.progress()
    if rank == 0:
        summary = {
            "learner": learner.learner_id, "ranks": dist.get_world_size(),
            "steps": learner.local_step, "tokens": learner.tokens, "eval_loss_start": start_loss,
            "eval_loss_end": task.eval_loss(model), "train_loss": loss,
            "fragments_applied": applied, "applied_versions": learner.applied_versions,
            "merged": progress["merged"], "dropped": progress["dropped"],
            "unsettled": learner.backlog, "seconds": round(time.monotonic() - started, 2),
        }
        say(json.dumps(summary))
    return 0


def say(line: str) -> None:
    """One line to stdout in one write: the ranks share the stream, and `print`
    writes a line and its newline separately, so lines of two ranks could merge."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
