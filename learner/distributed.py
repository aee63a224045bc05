"""`DistributedLearner`: a whole `torchrun` job as one learner of a run.

    dist.init_process_group("gloo")  # or "nccl"; torchrun sets rank and world size
    with DistributedLearner("coordinator:50051", model, sync_every=50) as learner:
        ddp = DistributedDataParallel(model)
        for batch in shard:
            ddp(batch).mean().backward(); opt.step(); opt.zero_grad()
            learner.step(tokens=batch.numel())

Data parallelism inside the job keeps every rank's parameters identical, so
only rank 0 needs a link to the synchronizer: it owns a real `Learner`, and
the other ranks copy from it whatever the synchronizer changed. At start
rank 0 joins and loads the global fragments, then every parameter goes out
from rank 0. At each step the ranks sum their token counts (the job's
contribution weighs as much as all the data it saw), rank 0 steps its
`Learner`, and tells the others which fragments it overwrote. The common
case, nothing, costs one small broadcast and the token all-reduce, and the
all-reduce is skipped when every rank gave a fixed `tokens_per_step`; an
applied fragment costs one broadcast per tensor of that fragment. Tensors stay on their device, so
gloo on CPU and nccl on CUDA work alike. No rank waits on the network
beyond what rank 0's `Learner` would, and `close` runs no collective, so it
is safe on an error path where the other ranks are gone.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import grpc
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from learner.api import Learner
from learner.fragments import FragmentPlan, plan_fragments
from protos.tls import TlsConfig

# Slot of the per-step signal that says rank 0's `Learner.step` raised.
_FAILED = -1


class DistributedError(RuntimeError):
    """Rank 0 failed (to join, or in a step); raised on the other ranks."""


class DistributedLearner:
    """One learner made of every rank of the default process group.

    Takes `Learner`'s arguments; all ranks must pass the same `fragments`
    and the same model architecture. `tokens_per_step` (each rank's own)
    lets `step()` go without a count, and is needed with `inner_optimizer`,
    whose every step then calls `step()`. `device="auto"` keeps the model where
    the caller put it (each rank on its own GPU, or the CPU).
    """

    def __init__(self, coordinator: str, model: torch.nn.Module,
                 inner_optimizer: torch.optim.Optimizer | None = None, *,
                 sync_every: int = 50, fragments: int = 4, overlap: int = 1,
                 alpha: float = 0.0, compression: str = "fp32", token: str | None = None,
                 learner_id: str | None = None, device: str | torch.device = "auto",
                 tokens_per_step: int | None = None, event_log: str = "",
                 connect_timeout_s: float = 60.0, max_backlog: int = 8,
                 tls: TlsConfig | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedLearner needs torch.distributed initialised first, "
                               "e.g. dist.init_process_group('gloo') under torchrun")
        if isinstance(model, DistributedDataParallel):
            model = model.module  # names without the wrapper's "module." prefix
        assert isinstance(model, torch.nn.Module)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        first = next(model.parameters(), None)
        if first is None:
            raise ValueError("the model has no parameters to synchronize")
        self.device = first.device if str(device) == "auto" else torch.device(device)
        self.model = model.to(self.device)
        self.plan: FragmentPlan = plan_fragments(self.model, fragments)
        self._params = dict(self.model.named_parameters())
        # Collectives need tensors on the backend's device: the GPU for nccl.
        self._signal_device = (self.device if dist.get_backend() == dist.Backend.NCCL
                               else torch.device("cpu"))
        self.local_step = 0
        # Tokens of every rank, summed: what rank 0 counts for the synchronizer.
        self.tokens = 0
        self._tokens_per_step = tokens_per_step
        self._job_tokens_per_step: int | None = None  # the ranks' sum, known after start()
        self._started = False
        self._closed = False
        self.learner: Learner | None = None
        # Rank 0 builds its Learner in start(), where a failure reaches every rank.
        # The optimizer hook lives here, on every rank, not in rank 0's Learner.
        self._learner_args: dict[str, Any] = dict(
            coordinator=coordinator, sync_every=sync_every, fragments=fragments,
            overlap=overlap, alpha=alpha, compression=compression, token=token,
            learner_id=learner_id, event_log=event_log, connect_timeout_s=connect_timeout_s,
            max_backlog=max_backlog, tls=tls)
        self._hook: Any = None
        if inner_optimizer is not None:
            if tokens_per_step is None:
                raise ValueError("with inner_optimizer, give tokens_per_step so each "
                                 "optimizer step can be counted")

            def after_optimizer_step(*_: object) -> None:
                self.step()

            self._hook = inner_optimizer.register_step_post_hook(after_optimizer_step)

    @property
    def learner_id(self) -> str | None:
        """The id rank 0 joined with; None on the other ranks."""
        return self.learner.learner_id if self.learner is not None else None

    def start(self) -> DistributedLearner:
        """Rank 0 joins and loads the global fragments; then every rank takes
        rank 0's parameters. Collective: every rank must call it; once is enough."""
        if self._started:
            return self
        failure: list[object] = [None]
        if self.rank == 0:
            try:
                self.learner = Learner(model=self.model, device=self.device,
                                       **self._learner_args)
                self.learner.start()
            except Exception as exc:
                self.learner = None
                failure[0] = _describe(exc)
                # Tell the others before raising, or they would wait on rank 0 forever.
                dist.broadcast_object_list(failure, src=0)
                raise
        dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:
            raise DistributedError(f"rank 0 could not join the run: {failure[0]}")
        self._broadcast(list(self._params.values()))
        self._job_tokens_per_step = self._sum_tokens_per_step()
        self._started = True
        return self

    def step(self, tokens: int | None = None) -> list[int]:
        """Call on every rank after each inner step with this rank's own tokens,
        or with none when every rank gave `tokens_per_step` (one collective
        fewer). Returns the fragments whose global values were written into
        the model, the same list on every rank. Collective: every rank must
        call it, all with a count or all without."""
        if not self._started:
            raise RuntimeError("call start() (on every rank) before step()")
        if tokens is None:
            if self._job_tokens_per_step is None:
                raise ValueError("step() without tokens needs tokens_per_step on every rank")
            job_tokens = self._job_tokens_per_step
        else:
            total = torch.tensor([tokens], dtype=torch.int64, device=self._signal_device)
            dist.all_reduce(total)
            job_tokens = int(total.item())
        self.local_step += 1
        self.tokens += job_tokens
        # One flag per fragment, and a last slot for "rank 0 failed".
        flags = torch.zeros(len(self.plan.fragments) + 1, dtype=torch.int8,
                            device=self._signal_device)
        if self.learner is not None:
            try:
                for p in self.learner.step(job_tokens):
                    flags[p] = 1
            except Exception:
                flags[_FAILED] = 1
                dist.broadcast(flags, src=0)
                raise
        dist.broadcast(flags, src=0)
        signal = flags.tolist()
        if signal[_FAILED]:
            raise DistributedError(f"rank 0 failed in step {self.local_step}; see its log")
        applied = [p for p, flag in enumerate(signal[:_FAILED]) if flag]
        if applied:
            self._broadcast([self._params[name] for p in applied
                             for name in self.plan.fragments[p].names])
        return applied

    def close(self, reason: str = "done") -> None:
        """Rank 0 flushes its pushes (bounded) and leaves; no collective, so
        any rank may call it on any path."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._closed:
            return
        self._closed = True
        if self.learner is not None:
            self.learner.close(reason)

    def __enter__(self) -> DistributedLearner:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close("done" if exc_type is None else f"error: {exc_type.__name__}")

    @property
    def backlog(self) -> int:
        """Rank 0's unsettled contributions; 0 on the other ranks."""
        return self.learner.backlog if self.learner is not None else 0

    @property
    def applied_versions(self) -> dict[int, int]:
        """Versions of the global fragments in the model; known on rank 0 only."""
        return self.learner.applied_versions if self.learner is not None else {}

    def progress(self) -> dict[str, Any]:
        """Rank 0: `Learner.progress()`; elsewhere just the step."""
        if self.learner is not None:
            return {**self.learner.progress(), "ranks": self.world_size}
        return {"step": self.local_step, "rank": self.rank}

    def _sum_tokens_per_step(self) -> int | None:
        """The job's tokens per step when every rank gave `tokens_per_step`."""
        given = self._tokens_per_step is not None
        counts = torch.tensor([self._tokens_per_step or 0, int(given)], dtype=torch.int64,
                              device=self._signal_device)
        dist.all_reduce(counts)
        total, ranks = (int(x) for x in counts.tolist())
        if ranks not in (0, self.world_size):
            raise ValueError(f"tokens_per_step given on {ranks} of {self.world_size} ranks; "
                             "give it on every rank or on none")
        return total if ranks else None

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values into every rank's `tensors`, in place, all in flight at once."""
        with torch.no_grad():
            works = [dist.broadcast(t.data, src=0, async_op=True) for t in tensors]
            for work in works:
                if work is not None:
                    work.wait()


def _describe(exc: Exception) -> str:
    """One line for the other ranks' error: gRPC errors by code and details."""
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
