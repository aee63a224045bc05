"""`Learner`: wrap a torch model so its fragments stream to a synchronizer.

    with Learner("coordinator:50051", model, sync_every=50, fragments=4) as learner:
        for batch in data:
            loss = model(batch).mean(); loss.backward(); opt.step(); opt.zero_grad()
            learner.step(tokens=batch.numel())

Training never waits on the network: pushes and pulls run on a background
thread, and a slow or absent coordinator only grows the backlog (reported by
`backlog` and in the event log). Pass `inner_optimizer` and
`tokens_per_step` to have `step` called after every optimizer step instead.

A learner restarting into a running run catches up from its peers: give it
the other learners' peer addresses (`peers=[...]`), and have every learner
serve its fragments (`serve_peers="HOST:PORT"`); `start` then loads each
fragment from a peer holding the published version, the rest from the
coordinator, and `catch_up` says where each came from.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal

import torch

from learner.client import Retry, SynchronizerClient
from learner.fragments import FragmentPlan, FragmentView, plan_fragments
from learner.peers import PeerSettings
from learner.schedule import DEFAULT_RULE, ApplyRule
from learner.streaming import CatchUp, FragmentSync, SyncSettings
from protos.events import EventLog
from protos.tls import TlsConfig
from protos.tls import load as load_tls


def resolve_device(device: str | torch.device) -> torch.device:
    """`auto`: the GPU when there is one, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {str(device)!r} is not a torch device ({exc})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: no CUDA device is available to this "
                         f"torch; use cpu or auto")
    return resolved


class Learner:
    """One learner of a run: a model, its fragment plan and a synchronizer link."""

    def __init__(self, coordinator: str, model: torch.nn.Module,
                 inner_optimizer: torch.optim.Optimizer | None = None, *,
                 sync_every: int | Literal["auto"] = 50, fragments: int = 4,
                 overlap: int = 1, alpha: float = 0.0, lockstep: bool = False,
                 compression: str = "fp32",
                 token: str | None = None,
                 learner_id: str | None = None, device: str | torch.device = "auto",
                 tokens_per_step: int | None = None, event_log: str = "",
                 connect_timeout_s: float = 60.0, max_backlog: int = 8,
                 peers: Sequence[str] = (), serve_peers: str | None = None,
                 peer_transport: str = "bulk", tls: TlsConfig | None = None,
                 compressed_pulls: bool = False, apply_rule: str = DEFAULT_RULE.value) -> None:
        """`sync_every`: H, the local steps between two pushes of a fragment, or
        "auto": the coordinator assigns it from this learner's step rate, so that
        learners of different speeds push each fragment equally often.
        `compressed_pulls`: pull each new version as a delta in the `compression`
        codec rather than the committed values in fp32; fewer bytes, but the held-out
        loss came out 5-9% worse (`bench.convergence --only ai,ai32`), so not the default.
        `apply_rule`: what applying a merged version keeps of the steps since the push
        (`learner.schedule.ApplyRule`: carry, the default, overwrite, boundary);
        `alpha` > 0 blends under the overwrite rule only."""
        peer_settings = PeerSettings(peers=tuple(peers), serve=serve_peers,
                                     transport=peer_transport,
                                     insecure=tls is not None and tls.insecure)
        material = load_tls(tls)  # a bad file is refused here, before anything starts
        self.device = resolve_device(device)
        self.model = model.to(self.device)
        self.plan: FragmentPlan = plan_fragments(self.model, fragments)
        self.learner_id = learner_id or f"{socket.gethostname()}-{os.getpid()}"
        self.events = EventLog(event_log, source=self.learner_id)
        self.client = SynchronizerClient(
            coordinator, self.learner_id, self.plan.hash, self.plan.numels, token=token,
            overlap_steps=overlap, codec=compression,
            retry=Retry(give_up_after_s=connect_timeout_s), events=self.events,
            device=str(self.device), tls=material,
            pull_codec=None if compressed_pulls else "fp32",
            auto_sync_every=sync_every == "auto")
        view = FragmentView(self.model, self.plan)
        self._sync = FragmentSync(
            self.client, SyncSettings(sync_every=sync_every, overlap_steps=overlap,
                                      alpha=alpha, max_backlog=max_backlog, lockstep=lockstep,
                                      rule=ApplyRule(apply_rule)),
            view.read, view.write, peer_settings)
        self._connect_timeout_s = connect_timeout_s
        self._hook: Any = None
        if inner_optimizer is not None:
            if tokens_per_step is None:
                raise ValueError("with inner_optimizer, give tokens_per_step so each "
                                 "optimizer step can be counted")
            counted = tokens_per_step

            def after_optimizer_step(*_: object) -> None:
                self.step(counted)

            self._hook = inner_optimizer.register_step_post_hook(after_optimizer_step)

    def start(self) -> Learner:
        """Join and load the run's current global fragments into the model. If that
        fails, the learner is closed (no `__exit__` follows a failed `__enter__`)."""
        try:
            self._sync.start(timeout=self._connect_timeout_s + 30)
        except BaseException:
            self.close("start failed")
            raise
        return self

    def step(self, tokens: int) -> list[int]:
        """Call after each inner step; returns the fragments updated from the
        synchronizer in this step. Never blocks on the network."""
        return self._sync.step(tokens)

    def close(self, reason: str = "done") -> None:
        """Flush queued pushes (bounded), leave the run and stop the background loop."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._sync.close(reason)
        self.events.close()

    def __enter__(self) -> Learner:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close("done" if exc_type is None else f"error: {exc_type.__name__}")

    @property
    def local_step(self) -> int:
        return self._sync.local_step

    @property
    def backlog(self) -> int:
        """Contributions not yet named by a committed manifest (queued or in flight)."""
        return self._sync.backlog

    @property
    def applied_versions(self) -> dict[int, int]:
        return dict(self._sync.applied_versions)

    @property
    def peer_address(self) -> str | None:
        """Where this learner serves its fragments to peers (once started), if it does."""
        return self._sync.peer_address

    @property
    def catch_up(self) -> CatchUp | None:
        """How `start` loaded the model: versions, sources, seconds."""
        return self._sync.catch_up

    def progress(self) -> dict[str, Any]:
        """What a progress line shows: step, versions, backlog, outbox outcomes."""
        return self._sync.progress()
