"""Streaming fragments for a training loop that never waits.

The training loop calls `step(tokens)` after each inner step. When to push a
fragment's outer gradient `Δ = Θ_base − θ`, which version to pull and when to
apply it, fall-backs and lost versions are the pure schedule's decisions
(`learner.schedule`); this module is its shell: it feeds the schedule the
steps, the acks, the pull results and the published versions, and carries out
the pushes, pulls and applies it returns, never blocking the loop on the
network (except in lock-step, and in `merge`, which the Flower adapter calls
between fits so that each starts from the last one's merge). A background
thread runs the gRPC client's event loop, the heartbeat and the pushes and
pulls, through bounded queues.
Parameters are seen as flat fp32 vectors through `read`/`write` callbacks, so
numpy and torch models share this.

Starting is a catch-up: join, then load every fragment at the versions the
synchronizer publishes, from peer learners that hold exactly those versions
(`learner.peers`) where peers are given, the rest from the coordinator. The
learner pushes nothing before it has caught up. With `serve` set, it serves
the merged values it holds to learners catching up, from the background loop.

Applying a merged version is an `ftsync.apply` span linked to the coordinator's
span of the round that committed it; the learner's metrics
(`learner.metrics`) count its pushes, backlog, apply lag and tokens per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from opentelemetry import trace

from learner.client import Pulled, SynchronizerClient
from learner.peers import Fetched, HeldFragments, PeerServer, PeerSettings, fetch_from_peers
from learner.schedule import (
    DEFAULT_RULE,
    Action,
    Apply,
    ApplyRule,
    FallBack,
    Pull,
    Push,
    Schedule,
    ScheduleConfig,
)
from protos import telemetry
from protos.settings import check

# Longest the training thread waits on the loop without looking at pending signals.
_SIGNAL_CHECK_S = 0.2
# How long an interrupted start or close may take to leave the run: its Leave waits
# up to 5 s, stopping the peer server 1 s.
_CLEANUP_S = 8.0

ReadFragment = Callable[[int], np.ndarray]
WriteFragment = Callable[[int, np.ndarray], None]

_TRACER = trace.get_tracer(__name__)


@dataclass
class _FragmentState:
    """What the shell keeps of a fragment beside the schedule's state."""

    # Where the next outer gradient is measured from: the last merged values
    # applied, or our own values at the last push (so two pushes never both
    # carry the same local progress when a merged version is slow to come).
    base: np.ndarray
    # Of the version applied last: tells it from the same number committed again.
    commit_id: int = 0
    since: float = field(default_factory=time.monotonic)
    # The runtime's total blocked time when `since` was taken.
    blocked_at_since: float = 0.0
    # When the push whose pull is under way was made (for the apply lag).
    pushed_at: float | None = None
    # The pull under way (on the loop), and what it brought until it is applied.
    pull: asyncio.Task[None] | None = None
    arrived: Pulled | None = None


@dataclass(frozen=True)
class _Outgoing:
    fragment: int
    delta: np.ndarray
    base_version: int
    tokens: int
    steps: int
    local_step: int
    work_s: float
    # Names the push in the schedule's `acked`.
    ticket: int
    pushed_at: float


@dataclass(frozen=True)
class SyncSettings:
    # H, or "auto": the coordinator assigns it at join and in heartbeats, from the
    # learners' measured step rates (the client must ask: `auto_sync_every`).
    sync_every: int | Literal["auto"] = 50
    overlap_steps: int = 1
    alpha: float = 0.0
    # Outer gradients waiting to be sent, beyond which the oldest is dropped.
    max_backlog: int = 8
    pull_wait_s: float = 30.0
    # Lock-step baseline: wait for the merged fragment when it is due instead of
    # training on (with a sync-mode coordinator this is synchronous DiLoCo).
    lockstep: bool = False
    # What an apply keeps of the steps since the push (`learner.schedule.ApplyRule`).
    rule: ApplyRule = DEFAULT_RULE

    def __post_init__(self) -> None:
        check(self, [
            (not isinstance(self.sync_every, str) or self.auto, "sync_every",
             "must be a number of steps or 'auto'"),
            (not (self.auto and self.lockstep), "sync_every",
             "'auto' needs lockstep off: lock-step keeps every learner in phase by one H "
             "for all"),
        ])
        self.schedule(1)  # the schedule's own checks, with their messages

    @property
    def auto(self) -> bool:
        return self.sync_every == "auto"

    def schedule(self, fragments: int) -> ScheduleConfig:
        """The schedule's config; with "auto" its H is τ until the coordinator's
        assignment at join replaces it (`Schedule.assigned`, before any step)."""
        h = self.overlap_steps if isinstance(self.sync_every, str) else self.sync_every
        return ScheduleConfig(h, fragments, self.overlap_steps, self.alpha, self.lockstep,
                              self.rule)


@dataclass(frozen=True)
class CatchUp:
    """How `start` loaded the model: the versions, where each fragment came from
    (a peer's address or `coordinator`), and the time from start to caught up."""

    versions: dict[int, int]
    sources: dict[int, str]
    seconds: float
    bytes_from_peers: int
    bytes_from_coordinator: int
    misses: list[str] = field(default_factory=list)


class FragmentSync:
    """Owns the background loop, the per-fragment base and the schedule."""

    def __init__(self, client: SynchronizerClient, settings: SyncSettings,
                 read: ReadFragment, write: WriteFragment,
                 peers: PeerSettings | None = None) -> None:
        # Spans go where OTEL_EXPORTER_OTLP_ENDPOINT (or FTSYNC_TRACE_CONSOLE) says.
        telemetry.configure_tracing("ftsync-learner", client.learner_id)
        if settings.auto != client.auto_sync_every:
            raise ValueError(f"sync_every {settings.sync_every!r} needs a client that "
                             f"{'asks' if settings.auto else 'does not ask'} for its H "
                             f"(SynchronizerClient auto_sync_every={settings.auto})")
        self.client = client
        self.settings = settings
        self.read = read
        self.write = write
        self.peers = peers or PeerSettings()
        self.schedule = Schedule(settings.schedule(len(client.numels)))
        self.fragments: list[_FragmentState] = []
        # The schedule is fed by the training thread (steps) and the loop (acks,
        # pulls); `_changed` wakes a lock-step wait when the loop fed it.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.applied_versions: dict[int, int] = {}
        # Merged values held for peers; only kept while serving them.
        self.held: HeldFragments | None = HeldFragments() if self.peers.serve else None
        self.peer_address: str | None = None
        self.catch_up: CatchUp | None = None
        self._peer_server: PeerServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ftsync-client",
                                        daemon=True)
        self._sends: asyncio.Queue[_Outgoing] | None = None
        # Time the training loop spent waiting for merges (lock-step, `merge`): not work.
        self._blocked_s = 0.0
        # Pulls that waited `pull_wait_s` and brought nothing.
        self.pull_timeouts = 0
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        # The H last handed to the schedule (sync_every "auto").
        self._assigned = 0

    # -- lifecycle -----------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        """Join, agree on the initial values with the other learners, start the loop.
        If that fails, what it started is stopped before the error is raised: it
        leaves the run if it may have joined (a Join sent, even one whose reply never
        came), closes its channels and peer server, and ends the loop and its thread."""
        self._thread.start()
        try:
            # The loop's own deadline comes first, so that a start that runs out of
            # time is cancelled and cleaned up there; this one only guards against
            # a loop that no longer answers.
            self._run(self._start_or_abandon(timeout), timeout + 15)
        except BaseException:
            if self._tasks:
                # The start had ended when the interrupt came: nothing cancelled it,
                # so leave the run as a close does, then stop.
                self.close("interrupted")
                raise
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()
            raise

    async def _start_or_abandon(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._start(), timeout)
        except BaseException:
            if self.client.may_be_member:  # say so now rather than time out
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.client.leave("start failed"), 5)
            if self._peer_server is not None:
                await self._peer_server.stop()
            await self.client.close()
            raise

    async def _start(self) -> None:
        started = time.monotonic()
        if self.peers.serve:
            assert self.held is not None
            client = self.client
            self._peer_server = PeerServer(
                self.held, lambda: (client.run_id, client.layout_hash), client.numels,
                lambda: client.chunk_bytes, client.events, client.learner_id, client.tls)
            self.peer_address = await self._peer_server.start(self.peers.serve,
                                                              self.peers.insecure)
        response = await self.client.join()
        if self.settings.auto:
            if not response.sync_every:
                raise RuntimeError(f"the coordinator at {self.client.address} assigned no "
                                   f"sync_every: 'auto' needs one that assigns H (a "
                                   f"coordinator of this version)")
            self.schedule.assigned(response.sync_every)
            self._assigned = response.sync_every
        # The published versions, read by the coordinator in one step: a consistent vector.
        published = {status.fragment: status for status in response.fragments}
        versions = {p: status.version for p, status in published.items()}
        for p, version in versions.items():
            if version < 0:
                await self.client.push_initial(p, self.read(p))
        loaded: dict[int, Pulled] = {}
        sources: dict[int, str] = {}
        misses: list[str] = []

        writing = asyncio.Lock()

        async def load(p: int, pulled: Pulled, source: str) -> None:
            # Written as it arrives, while other fragments still stream; one at a
            # time, as the training thread would.
            async with writing:
                await asyncio.to_thread(self.write, p, pulled.values)
            loaded[p], sources[p] = pulled, source

        async def from_peer(fetched: Fetched) -> None:
            await load(fetched.fragment, Pulled(fetched.fragment, fetched.version,
                                                fetched.values, 0, fetched.commit_id),
                       fetched.source)

        if self.peers.peers and min(versions.values()) >= 0:
            report = await fetch_from_peers(
                [a for a in self.peers.peers if a != self.peer_address], self.client.run_id,
                self.client.layout_hash, published, self.client.numels,
                transport=self.peers.transport, concurrency=self.peers.concurrency,
                idle_timeout_s=self.peers.idle_timeout_s, deliver=from_peer,
                tls=self.client.tls)
            misses = report.misses
        for p, pulled in (await self._from_coordinator(
                {p: v for p, v in versions.items() if p not in loaded})).items():
            await load(p, pulled, "coordinator")
        for p in range(len(self.client.numels)):
            pulled = loaded[p]
            # The pulled array is never written in place, so it can be the base as it is.
            self.fragments.append(_FragmentState(base=pulled.values, commit_id=pulled.commit_id))
            self.applied_versions[p] = pulled.version
            if self.held is not None:
                self.held.applied(p, pulled.version, pulled.commit_id, pulled.values)
        self.catch_up = CatchUp(
            versions=dict(self.applied_versions), sources=sources,
            seconds=time.monotonic() - started,
            bytes_from_peers=sum(4 * loaded[p].values.size for p, s in sources.items()
                                 if s != "coordinator"),
            bytes_from_coordinator=sum(4 * loaded[p].values.size for p, s in sources.items()
                                       if s == "coordinator"),
            misses=misses)
        self.client.events.emit(
            "catch_up", learner=self.client.learner_id, versions=self.catch_up.versions,
            sources=sources, seconds=round(self.catch_up.seconds, 4),
            bytes_from_peers=self.catch_up.bytes_from_peers,
            bytes_from_coordinator=self.catch_up.bytes_from_coordinator, misses=misses[:20])
        # In lock-step it resumes at the step that keeps it in phase with the others.
        self.schedule.start(self.applied_versions,
                            {p: loaded[p].commit_id for p in self.applied_versions})
        self._sends = asyncio.Queue()
        self._tasks = [self._loop.create_task(self._sender(), name="sender"),
                       self._loop.create_task(self._heartbeats(), name="heartbeats")]

    def close(self, reason: str = "done", flush_timeout: float = 30.0) -> None:
        """Push the work not yet pushed, send what is queued (within the
        timeout), leave, stop the loop."""
        if not self._thread.is_alive():
            return
        if self.fragments:
            with self._lock:
                pushes = self.schedule.flush()
            self._carry_out(pushes)
        self._stopping = True
        try:
            self._run(self._close(reason, flush_timeout), flush_timeout + 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()

    async def _close(self, reason: str, flush_timeout: float) -> None:
        try:
            if self._sends is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._sends.join(), timeout=flush_timeout)
        finally:  # an interrupted flush (Ctrl-C) still leaves the run
            pulls = [state.pull for state in self.fragments if state.pull is not None]
            for task in [*self._tasks, *pulls]:  # no heartbeat after the Leave
                task.cancel()
            await asyncio.gather(*self._tasks, *pulls, return_exceptions=True)
            if self._peer_server is not None:
                await self._peer_server.stop()
            await self.client.leave(reason)
            await self.client.close()
            telemetry.flush_traces()

    async def _from_coordinator(self, versions: dict[int, int]) -> dict[int, Pulled]:
        """The fragments no peer served, from the coordinator: each at its current
        version (it keeps only the latest, so that may be newer than asked)."""
        if not versions:
            return {}
        if len(versions) < len(self.client.numels):
            pulls = await asyncio.gather(*(self.client.pull(p, v - 1, wait_s=0.0)
                                           for p, v in versions.items()))
            found = {pulled.fragment: pulled for pulled in pulls if pulled is not None}
            if len(found) == len(versions):
                return found
        snapshot: dict[int, Pulled] = {}
        while not all(p in snapshot for p in versions):
            snapshot = await self.client.snapshot()
            if not all(p in snapshot for p in versions):
                await asyncio.sleep(0.1)  # another learner is still pushing its init
        return {p: snapshot[p] for p in versions}

    # -- the training loop's side --------------------------------------------------

    @property
    def local_step(self) -> int:
        return self.schedule.step_count

    def step(self, tokens: int) -> list[int]:
        """Call after every inner step; never blocks on the network (but in
        lock-step). Returns the fragments whose merged values were written into
        the model this step."""
        if self._sends is None or self._stopping:
            # Steps counted without a run would shift every fragment's schedule.
            raise RuntimeError("step() needs a started learner that is not closed: call "
                               "start() first (or use it as a context manager)")
        k = self.schedule.step_count + 1
        with self._lock:
            for p, (version, commit_id) in list(self.client.published.items()):
                if p < len(self.fragments):
                    self.schedule.published(p, version, commit_id)
            assigned = self.client.sync_every
            if self.settings.auto and assigned != self._assigned:
                self.schedule.assigned(assigned)  # at the next cycle boundary
                self._assigned = assigned
            if self.schedule.waits_at(k):
                self._wait_for(lambda: not self.schedule.waits_at(k))
            actions = self.schedule.step(k, tokens)
        return self._carry_out(actions)

    def merge(self) -> list[int]:
        """Wait until every push and pull so far is answered (each pull waits at
        most `pull_wait_s`), then apply what the pulls brought at once: for a
        driver whose next step starts from this step's merge (the Flower adapter,
        whose step is a whole fit). Returns the fragments applied."""
        if self._sends is None or self._stopping:
            raise RuntimeError("merge() needs a started learner that is not closed")
        with self._lock:
            self._wait_for(lambda: not self.schedule.unanswered())
            actions = self.schedule.apply_now()
        return self._carry_out(actions)

    def _wait_for(self, done: Callable[[], bool]) -> None:
        """Block the training thread (holding `_lock`) until the loop has fed the
        schedule what `done` needs; the time blocked is not work. Waits in short
        slices, so that a signal (Ctrl-C) is handled while it waits."""
        waited_from = time.monotonic()
        while not self._changed.wait_for(done, _SIGNAL_CHECK_S):
            pass
        self._blocked_s += time.monotonic() - waited_from

    @property
    def backlog(self) -> int:
        queued = self._sends.qsize() if self._sends is not None else 0
        return queued + self.client.backlog

    def progress(self) -> dict[str, Any]:
        """Step, H in force, versions pushed into and applied, backlog, outbox outcomes."""
        stats = self.client.stats
        return {"step": self.local_step, "sync_every": self.schedule.sync_every,
                "pushed": dict(stats.pushed),
                "versions": dict(self.applied_versions), "backlog": self.backlog,
                "merged": stats.merged, "dropped": dict(stats.dropped),
                "repushed": stats.repushed}

    def _carry_out(self, actions: list[Action]) -> list[int]:
        """Do what the schedule decided, in its order (training thread); the
        fragments applied."""
        applied = []
        fell_back: set[int] = set()
        for action in actions:
            if isinstance(action, Push):
                self._push(action)
            elif isinstance(action, Apply):
                self._apply(action)
                applied.append(action.p)
            elif isinstance(action, FallBack):
                fell_back.add(action.p)
                self.client.events.emit("pull_fallback", learner=self.client.learner_id,
                                        fragment=action.p, step=self.local_step,
                                        base_version=self.schedule.version(action.p))
            else:
                if action.p not in fell_back:
                    self._version_lost(action)
                self._loop.call_soon_threadsafe(self._start_pull, action)
        return applied

    def _push(self, push: Push) -> None:
        state = self.fragments[push.p]
        current = self.read(push.p)
        now = time.monotonic()
        work_s = now - state.since - (self._blocked_s - state.blocked_at_since)
        item = _Outgoing(push.p, state.base - current, push.base, push.tokens, push.steps,
                         push.step, work_s, push.ticket, now)
        if work_s > 0 and push.tokens > 0:
            self.client.metrics.tokens_per_s.set(push.tokens / work_s)
        state.base = current
        state.since, state.blocked_at_since = now, self._blocked_s
        assert self._sends is not None
        self._loop.call_soon_threadsafe(self._enqueue, item)

    def _version_lost(self, pull: Pull) -> None:
        """The coordinator reports the applied version under another commit: it lost
        it (a failover under async replication, a restored state directory) and
        committed the number again; the schedule pulls its replacement."""
        state = self.fragments[pull.p]
        version, commit_id = self.client.published.get(pull.p, (-1, 0))
        self.client.events.emit("version_lost", learner=self.client.learner_id,
                                fragment=pull.p, version=version,
                                had_commit=f"{state.commit_id:x}", commit=f"{commit_id:x}")
        state.pushed_at = None  # no push of this learner's waits on this pull

    def _start_pull(self, pull: Pull, pushed_at: float | None = None) -> None:
        """Start `pull` (on the loop), replacing the fragment's pull under way. It
        tells the peers' server at once that a newer version may come."""
        state = self.fragments[pull.p]
        if state.pull is not None:
            state.pull.cancel()
        if pushed_at is not None:
            state.pushed_at = pushed_at
        waiting = contextlib.ExitStack()
        waiting.enter_context(self._awaiting(pull.p, pull.newer_than))
        state.pull = self._loop.create_task(self._pull(pull, waiting), name=f"pull-{pull.p}")

    async def _pull(self, pull: Pull, waiting: contextlib.ExitStack) -> None:
        with waiting:
            try:
                pulled = await self.client.pull_newer(pull.p, pull.newer_than,
                                                      self.settings.pull_wait_s)
                if pulled is None:  # the schedule decides what the learner does now
                    self.pull_timeouts += 1
                    self.client.events.emit("pull_timeout", learner=self.client.learner_id,
                                            fragment=pull.p, have_version=pull.newer_than)
            except Exception as exc:  # the schedule pulls again at the next push
                self.client.events.emit("pull_failed", learner=self.client.learner_id,
                                        fragment=pull.p, error=str(exc)[:200])
                pulled = None
            if pulled is not None and self.held is not None:
                # Servable to peers from now on, before this learner applies it.
                self.held.pulled(pull.p, pulled.version, pulled.commit_id, pulled.values)
        with self._changed:
            if pulled is None:
                self.schedule.pulled(pull.p, None, 0, pull.ticket)
            elif self.schedule.pulled(pull.p, pulled.version, pulled.commit_id, pull.ticket,
                                      pulled.rewound):
                self.fragments[pull.p].arrived = pulled
            self._changed.notify_all()

    def _awaiting(self, p: int, have_version: int) -> contextlib.AbstractContextManager[None]:
        """Tells the peers' server that a version newer than `have_version` may come:
        from the push on, since the round it closes commits before the pull starts."""
        if self.held is None:
            return contextlib.nullcontext()
        return self.held.awaiting(p, have_version)

    def _enqueue(self, item: _Outgoing) -> None:
        assert self._sends is not None
        while self._sends.qsize() >= self.settings.max_backlog:
            dropped = self._sends.get_nowait()
            self._acked(dropped, None)
            self._sends.task_done()
            self.client.count_drop(dropped.fragment, "backlog_full", work_s=dropped.work_s)
        self._sends.put_nowait(item)

    def _acked(self, item: _Outgoing, target: int | None) -> None:
        """The schedule learns the push's target version (None: not acknowledged),
        and the pull it asks for starts now, on the loop."""
        with self._changed:
            pulls = self.schedule.acked(item.fragment, target, item.ticket)
            self._changed.notify_all()
        for pull in pulls:
            self._start_pull(pull, item.pushed_at)

    def _apply(self, apply: Apply) -> None:
        p, state = apply.p, self.fragments[apply.p]
        pulled, state.arrived = state.arrived, None
        assert pulled is not None and pulled.version == apply.version
        lag = None if state.pushed_at is None else time.monotonic() - state.pushed_at
        with _TRACER.start_as_current_span("ftsync.apply", links=telemetry.links([pulled.trace]),
                                           attributes={"ftsync.learner": self.client.learner_id,
                                                       "ftsync.fragment": p,
                                                       "ftsync.version": pulled.version,
                                                       "ftsync.step": self.local_step}):
            if apply.carry:  # the progress since the push rides on the merged version
                values = pulled.values + (self.read(p) - state.base)
            elif apply.alpha == 0:
                values = pulled.values
            else:
                values = apply.alpha * self.read(p) + (1 - apply.alpha) * pulled.values
            self.write(p, values)
        if lag is not None:
            self.client.metrics.apply_lag.record(lag)
        state.pushed_at = None
        state.base, state.commit_id = pulled.values, pulled.commit_id
        if not apply.carry:  # the steps since the push are overwritten: not work
            state.since, state.blocked_at_since = time.monotonic(), self._blocked_s
        self.applied_versions[p] = pulled.version
        if self.held is not None:
            self.held.applied(p, pulled.version, pulled.commit_id, pulled.values)
        self.client.events.emit("applied", learner=self.client.learner_id, fragment=p,
                                version=pulled.version, step=self.local_step)

    # -- the background loop ---------------------------------------------------------

    async def _sender(self) -> None:
        assert self._sends is not None
        while True:
            item = await self._sends.get()
            target = None
            # The round this push goes to may commit a version newer than its base.
            with self._awaiting(item.fragment, item.base_version):
                try:
                    if item.tokens > 0 and item.steps > 0:
                        target = await self.client.push(
                            item.fragment, item.delta, item.base_version, item.tokens,
                            item.steps, item.local_step, work_s=item.work_s)
                except Exception as exc:  # reported; training goes on
                    self.client.events.emit("push_failed", learner=self.client.learner_id,
                                            fragment=item.fragment, error=str(exc)[:200])
                finally:
                    self._acked(item, target)
                    self._sends.task_done()

    async def _heartbeats(self) -> None:
        while not self._stopping:
            self.client.metrics.backlog.set(self.backlog)
            try:
                await self.client.heartbeat(self.local_step)
                await self.client.repush_unacknowledged()
            except Exception as exc:  # the next beat tries again
                self.client.events.emit("heartbeat_failed", learner=self.client.learner_id,
                                        error=str(exc)[:200])
            await asyncio.sleep(self.client.heartbeat_interval_s)

    def _run(self, coroutine: Coroutine[Any, Any, None], timeout: float) -> None:
        """Run `coroutine` on the loop and wait for it, in short slices: a signal the
        kernel delivers to one of gRPC's threads only runs its Python handler (Ctrl-C)
        once the main thread wakes, and one long wait would hold it back for minutes."""
        finished = threading.Event()
        future = asyncio.run_coroutine_threadsafe(_setting_when_done(finished, coroutine),
                                                  self._loop)
        deadline = time.monotonic() + timeout
        while True:
            try:
                future.result(min(_SIGNAL_CHECK_S, max(deadline - time.monotonic(), 0.0)))
                return
            except TimeoutError:
                # The coroutine's own TimeoutError, or the whole wait ran out.
                if future.done() or time.monotonic() >= deadline:
                    raise
            except KeyboardInterrupt:
                # Cancelled, the coroutine cleans up on the loop (a start that had
                # joined leaves the run); give that a moment before the loop stops.
                future.cancel()
                finished.wait(_CLEANUP_S)
                raise


async def _setting_when_done(finished: threading.Event,
                             coroutine: Coroutine[Any, Any, None]) -> None:
    try:
        await coroutine
    finally:
        finished.set()
