"""A torchrun job as one learner: two gloo ranks on CPU against a real daemon.

The example (`learner.examples.ddp_train`) runs under `torch.distributed.run`
as the user runs it; the coordinator must see one learner whose contributions
count both ranks' tokens, and the ranks must end bit-identical. Spawned
ranks without DDP then check the parts DDP would hide: the start broadcast,
per-fragment broadcasts between ranks that drifted apart, and a failed join
reaching every rank instead of leaving it waiting.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist

from learner.distributed import DistributedError, DistributedLearner
from protos import ftsync_pb2 as pb
from tests.daemon import Daemon

STEPS, BATCH, SYNC_EVERY, FRAGMENTS = 200, 48, 20, 3


@dataclass
class Run:
    result: subprocess.CompletedProcess[str]
    lines: list[dict[str, Any]]
    status: pb.StatusResponse
    events: list[dict[str, Any]]

    @property
    def summary(self) -> dict[str, Any]:
        (summary,) = [line for line in self.lines if "eval_loss_start" in line]
        return summary


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """One 2-rank torchrun job of the example against its own daemon."""
    tmp = tmp_path_factory.mktemp("ddp")
    events = tmp / "coordinator.jsonl"
    daemon = Daemon(state_dir=tmp / "state", args=[
        "--event-log", str(events), "--set", "policy.staleness_exponent=0.5"]).start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", "-m", "learner.examples.ddp_train",
             "--coordinator", daemon.address, "--learner-id", "ddp-job",
             "--steps", str(STEPS), "--batch", str(BATCH), "--sync-every", str(SYNC_EVERY),
             "--fragments", str(FRAGMENTS), "--overlap", "2", "--collective-timeout", "60"],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        status = daemon.status()
    finally:
        daemon.stop()
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    recorded = [json.loads(line) for line in events.read_text().splitlines()]
    yield Run(result, lines, status, recorded)


def test_a_two_rank_job_trains_as_one_learner_and_ends_identical(ddp_run: Run) -> None:
    result = ddp_run.result
    assert result.returncode == 0, result.stdout + result.stderr
    summary = ddp_run.summary
    assert summary["ranks"] == 2 and summary["steps"] == STEPS
    assert summary["tokens"] == 2 * BATCH * STEPS
    assert summary["eval_loss_end"] < 0.5 * summary["eval_loss_start"], summary
    # 28 pushes are due in 200 steps; a pull that comes late is applied late or skipped.
    assert summary["fragments_applied"] >= 2 * FRAGMENTS
    # Only rank 0 ever talked to the synchronizer.
    assert [lr.learner_id for lr in ddp_run.status.learners] == ["ddp-job"]
    (learner,) = ddp_run.status.learners
    assert learner.contributions >= 20
    assert {e["learner"] for e in ddp_run.events if "learner" in e} == {"ddp-job"}
    assert all(f.version >= 2 for f in ddp_run.status.fragments)
    # DDP keeps the ranks equal between syncs; the fragment broadcasts keep them equal across.
    checksums = {line["rank"]: line["params_sha256"] for line in ddp_run.lines
                 if "params_sha256" in line}
    assert set(checksums) == {0, 1} and checksums[0] == checksums[1]


def test_contributions_weigh_the_tokens_of_every_rank(ddp_run: Run) -> None:
    acks = [e for e in ddp_run.events if e["kind"] == "push_ack"]
    assert acks
    job_tokens_per_step = 2 * BATCH
    for fragment in range(FRAGMENTS):
        first = min((e for e in acks if e["fragment"] == fragment), key=lambda e: e["seq"])
        # w = c_tokens²/c_steps·(1+s)^-0.5, s = 0 here; the first push of fragment p comes
        # after t_p + H steps, t_p = floor(p·H/P).
        steps = fragment * SYNC_EVERY // FRAGMENTS + SYNC_EVERY
        assert first["staleness"] == 0
        assert first["weight"] == pytest.approx(job_tokens_per_step**2 * steps), first
    for ack in acks:
        # Every step counted both ranks: c_tokens = 96·c_steps, so w·√(1+s)/96² is c_steps.
        c_steps = ack["weight"] * math.sqrt(1 + ack["staleness"]) / job_tokens_per_step**2
        assert c_steps == pytest.approx(round(c_steps), abs=1e-6) and c_steps >= 1, ack


# -- spawned ranks, no DDP -------------------------------------------------------------


def _digest(tensors: Iterable[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _rank(rank: int, store: str, address: str, out: str, steps: int, hook: bool) -> None:
    """A rank that never averages gradients: each one drifts its own way. With
    `hook`, its optimizer's steps call `step()`; else it calls `step(tokens)`."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    record: dict[str, Any] = {"rank": rank}
    try:
        torch.manual_seed(rank)  # different initial values on each rank
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        tokens = 10 * (rank + 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        learner = DistributedLearner(
            address, model, optimizer if hook else None, sync_every=4, fragments=2,
            overlap=1, device="cpu", connect_timeout_s=1.0,
            tokens_per_step=tokens if hook else None)
        try:
            learner.start()
        except Exception as exc:
            record["start_error"] = f"{type(exc).__name__}: {exc}"
            _exit_cleanly(out, rank, record)
        fragment_params = [[dict(model.named_parameters())[n] for n in f.names]
                           for f in learner.plan.fragments]
        record["after_start"] = _digest(model.parameters())
        record["steps"] = []
        with learner:
            for _ in range(steps):
                for p in model.parameters():
                    p.grad = torch.full_like(p, -float(rank + 1))
                time.sleep(0.01)  # stands in for an inner step's compute
                optimizer.step()
                applied = None if hook else learner.step(tokens)
                record["steps"].append({"applied": applied,
                                        "fragments": [_digest(t) for t in fragment_params]})
        record["tokens"] = learner.tokens
    except BaseException:
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
        dist.destroy_process_group()
        raise
    _exit_cleanly(out, rank, record)


def _exit_cleanly(out: str, rank: int, record: dict[str, Any]) -> NoReturn:
    """Write the rank's record and go without the interpreter's teardown, as
    `ftsync-learner` exits: after a failed join, tearing down gRPC's and gloo's
    threads aborted a rank (SIGABRT, "terminate called without an active
    exception") in 3 of 6 full-suite runs. What the tests check is in the record."""
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    os._exit(0)


def _spawn(tmp_path: Path, address: str, steps: int,
           hook: bool = False) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")  # fresh interpreters, as torchrun's
    ranks = [context.Process(target=_rank, args=(rank, str(tmp_path / "store"), address,
                                                 str(tmp_path), steps, hook))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        for process in ranks:
            process.join(timeout=60)
            assert process.exitcode == 0, f"rank exited with {process.exitcode}"
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hook", [False, True], ids=["step-tokens", "optimizer-hook"])
def test_ranks_start_from_the_global_values_and_take_each_applied_fragment(
        start_daemon: Callable[..., Daemon], tmp_path: Path, hook: bool) -> None:
    daemon = start_daemon("--set", "policy.grace_max_s=0")
    rank0, rank1 = _spawn(tmp_path, daemon.address, steps=60, hook=hook)
    assert rank0["after_start"] == rank1["after_start"]
    assert rank0["tokens"] == rank1["tokens"] == 60 * (10 + 20)
    applied = 0
    for s0, s1 in zip(rank0["steps"], rank1["steps"], strict=True):
        # The ranks step differently, so a fragment is equal on both only when
        # rank 0 just wrote the global values into it and broadcast them.
        same = [p for p in range(2) if s0["fragments"][p] == s1["fragments"][p]]
        if not hook:
            assert s0["applied"] == s1["applied"] == same
        applied += len(same)
    assert applied >= 10
    (learner,) = daemon.status().learners
    assert learner.contributions >= 20  # 15 per fragment are due in 60 steps


@pytest.mark.timeout(90)
def test_a_failed_join_on_rank_0_fails_every_rank(tmp_path: Path) -> None:
    # Nothing listens on port 9 (discard) here: rank 0 gives up after connect_timeout_s.
    rank0, rank1 = _spawn(tmp_path, "127.0.0.1:9", steps=1)
    assert rank0["start_error"].startswith("AioRpcError"), rank0
    error = rank1["start_error"]
    # Rank 1 hears why, in one line, instead of waiting on rank 0 for ever.
    assert error.startswith(f"{DistributedError.__name__}: rank 0 could not join the run: "
                            "UNAVAILABLE: "), error
    assert "\n" not in error
