"""Streaming fragments for a training loop that never waits.

The training loop calls `step(tokens)` after each inner step. Fragment p is
due when `(step − t_p) mod H == 0` with `t_p = floor(p·H/P)`: its outer
gradient `Δ = Θ_base − θ` goes to the synchronizer in the background, and
the version that merges it is applied `τ` steps later as
`θ ← α·θ + (1−α)·Θ_new` (as soon after as it has arrived; the loop never
blocks on it). When that version is still not there τ steps after that, the
newest one is taken instead. A background
thread runs the gRPC client's event loop, the heartbeat and the pushes and
pulls, through bounded queues. Parameters are seen as flat fp32 vectors
through `read`/`write` callbacks, so numpy and torch models share this.

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
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opentelemetry import trace

from learner.client import Pulled, SynchronizerClient
from learner.peers import Fetched, HeldFragments, PeerServer, PeerSettings, fetch_from_peers
from protos import telemetry

# Longest the training thread waits on the loop without looking at pending signals.
_SIGNAL_CHECK_S = 0.2
# How long an interrupted start or close may take to leave the run: its Leave waits
# up to 5 s, stopping the peer server 1 s.
_CLEANUP_S = 8.0

ReadFragment = Callable[[int], np.ndarray]
WriteFragment = Callable[[int, np.ndarray], None]

_TRACER = trace.get_tracer(__name__)


def offsets(sync_every: int, fragments: int) -> list[int]:
    """t_p = floor(p·H/P): fragments are due at staggered steps."""
    return [p * sync_every // fragments for p in range(fragments)]


def due_fragments(step: int, sync_every: int, fragments: int) -> list[int]:
    """Fragments whose outer gradient is due after inner step `step` (1-based)."""
    return [p for p, t in enumerate(offsets(sync_every, fragments))
            if step > t and (step - t) % sync_every == 0]


def lockstep_resume_step(versions: dict[int, int], sync_every: int) -> int:
    """The local step a learner joining a lock-step run resumes at.

    In lock-step every learner pushes fragment p for version v at step
    `t_p + v·H`. A learner that restarted at step 0 would push in another
    phase than the others, and each side would wait for a round the other
    has not reached. Resuming at `max_p (t_p + v_p·H)` over the published
    versions (0 for a fragment at v0) makes its next push of every fragment
    the one for version `v_p + 1`."""
    starts = offsets(sync_every, len(versions))
    return max((starts[p] + v * sync_every if v > 0 else 0 for p, v in versions.items()),
               default=0)


@dataclass
class _FragmentState:
    # Where the next outer gradient is measured from: the last merged values
    # applied, or our own values at the last push (so two pushes never both
    # carry the same local progress when a merged version is slow to come).
    base: np.ndarray
    base_version: int
    # Of the version applied last: tells it from the same number committed again.
    base_commit_id: int = 0
    tokens: int = 0
    steps: int = 0
    since: float = field(default_factory=time.monotonic)
    # The runtime's total blocked time when `since` was taken.
    blocked_at_since: float = 0.0
    apply_at: int | None = None
    pending: Future[Pulled | None] | None = None
    # The pull gave up waiting for the version holding the push (see _fall_back).
    fell_back: bool = False
    # The pull under way is `_check_history`'s, not a push's own.
    lost_pull: bool = False
    # When the push whose pull is under way was made (for the apply lag).
    pushed_at: float | None = None


@dataclass(frozen=True)
class _Outgoing:
    fragment: int
    delta: np.ndarray
    base_version: int
    tokens: int
    steps: int
    local_step: int
    work_s: float
    # The version the coordinator will merge this into (None when not pushed).
    target: Future[int | None] = field(default_factory=Future)


@dataclass(frozen=True)
class SyncSettings:
    sync_every: int = 50
    overlap_steps: int = 1
    alpha: float = 0.0
    # Outer gradients waiting to be sent, beyond which the oldest is dropped.
    max_backlog: int = 8
    pull_wait_s: float = 30.0
    # Lock-step baseline: wait for the merged fragment when it is due instead of
    # training on (with a sync-mode coordinator this is synchronous DiLoCo).
    lockstep: bool = False

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        if self.overlap_steps < 1:
            raise ValueError(f"overlap (τ) must be >= 1, got {self.overlap_steps}")
        if self.overlap_steps > self.sync_every:
            # The fragment would come due again before its merge is applied.
            raise ValueError(f"overlap (τ) must be at most sync_every (H): got τ = "
                             f"{self.overlap_steps}, H = {self.sync_every}")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {self.alpha}")


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
        self.client = client
        self.settings = settings
        self.read = read
        self.write = write
        self.peers = peers or PeerSettings()
        self.local_step = 0
        self.fragments: list[_FragmentState] = []
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
        # Time the training loop spent waiting for merges (lock-step only): not work.
        self._blocked_s = 0.0
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []

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
            self.fragments.append(_FragmentState(base=pulled.values,
                                                 base_version=pulled.version,
                                                 base_commit_id=pulled.commit_id))
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
        if self.settings.lockstep:
            self.local_step = lockstep_resume_step(self.applied_versions,
                                                   self.settings.sync_every)
        self._sends = asyncio.Queue()
        self._tasks = [self._loop.create_task(self._sender(), name="sender"),
                       self._loop.create_task(self._heartbeats(), name="heartbeats")]

    def close(self, reason: str = "done", flush_timeout: float = 30.0) -> None:
        """Push the work not yet pushed, send what is queued (within the
        timeout), leave, stop the loop."""
        if not self._thread.is_alive():
            return
        for p, state in enumerate(self.fragments):
            if state.steps > 0:
                self._push(p)
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
            for task in self._tasks:  # no heartbeat after the Leave
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
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

    def step(self, tokens: int) -> list[int]:
        """Call after every inner step; never blocks on the network. Returns the
        fragments whose merged values were written into the model this step."""
        if self._sends is None or self._stopping:
            # Steps counted without a run would shift every fragment's schedule.
            raise RuntimeError("step() needs a started learner that is not closed: call "
                               "start() first (or use it as a context manager)")
        self.local_step += 1
        for state in self.fragments:
            state.tokens += tokens
            state.steps += 1
        applied = [p for p, state in enumerate(self.fragments) if self._maybe_apply(p, state)]
        for p in due_fragments(self.local_step, self.settings.sync_every, len(self.fragments)):
            self._push(p)
        # After the pushes: a fragment pushed just now has its own pull under way.
        for p, state in enumerate(self.fragments):
            self._check_history(p, state)
        return applied

    @property
    def backlog(self) -> int:
        queued = self._sends.qsize() if self._sends is not None else 0
        return queued + self.client.backlog

    def progress(self) -> dict[str, Any]:
        """Step, versions pushed into and applied, backlog, outbox outcomes."""
        stats = self.client.stats
        return {"step": self.local_step, "pushed": dict(stats.pushed),
                "versions": dict(self.applied_versions), "backlog": self.backlog,
                "merged": stats.merged, "dropped": dict(stats.dropped),
                "repushed": stats.repushed}

    def _push(self, p: int) -> None:
        state = self.fragments[p]
        current = self.read(p)
        now = time.monotonic()
        work_s = now - state.since - (self._blocked_s - state.blocked_at_since)
        item = _Outgoing(p, state.base - current, state.base_version, state.tokens,
                         state.steps, self.local_step, work_s)
        if work_s > 0 and state.tokens > 0:
            self.client.metrics.tokens_per_s.set(state.tokens / work_s)
        state.base, state.tokens, state.steps = current, 0, 0
        state.since, state.blocked_at_since = now, self._blocked_s
        assert self._sends is not None
        self._loop.call_soon_threadsafe(self._enqueue, item)
        if state.lost_pull and state.pending is not None:
            # This push's own pull brings a version past the one committed again.
            state.pending.cancel()
            state.pending = None
        if state.pending is None:
            state.lost_pull = False
            state.pushed_at = now
            state.apply_at = self.local_step + self.settings.overlap_steps
            state.fell_back = False
            state.pending = asyncio.run_coroutine_threadsafe(
                self._pull_own(p, state.base_version, item.target), self._loop)

    async def _pull_own(self, p: int, base_version: int,
                        target: Future[int | None]) -> Pulled | None:
        """The first version that holds this push: an earlier one (another learner's
        round) lacks the progress just pushed. In lock-step, the next version: a push
        that missed its round waits for the next one, which needs the others' next
        pushes, which wait for this learner."""
        with self._awaiting(p, base_version):
            # Shielded: cancelling this pull (a fall-back) must not cancel the sender's future.
            merged_into = await asyncio.shield(asyncio.wrap_future(target))
        # The pull registers its narrower wait before the loop runs anything else.
        if merged_into is None or self.settings.lockstep:
            return await self._pull(p, base_version)
        return await self._pull(p, max(base_version, merged_into - 1))

    async def _pull(self, p: int, have_version: int) -> Pulled | None:
        with self._awaiting(p, have_version):
            pulled = await self.client.pull_newer(p, have_version, self.settings.pull_wait_s)
            if pulled is not None and self.held is not None:
                # Servable to peers from now on, before this learner applies it.
                self.held.pulled(p, pulled.version, pulled.commit_id, pulled.values)
            return pulled

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
            dropped.target.set_result(None)
            self._sends.task_done()
            self.client.count_drop(dropped.fragment, "backlog_full", work_s=dropped.work_s)
        self._sends.put_nowait(item)

    def _fall_back(self, p: int, state: _FragmentState) -> None:
        """The round holding the push is slow to close (its quorum still gathering):
        after τ more steps, take the newest version instead. Waiting on would leave
        the base to age until pushes are refused as stale, and cost the local steps
        that the version, when it comes, overwrites."""
        assert state.pending is not None
        state.pending.cancel()
        state.pending = asyncio.run_coroutine_threadsafe(self._pull(p, state.base_version),
                                                         self._loop)
        state.fell_back = True
        self.client.events.emit("pull_fallback", learner=self.client.learner_id, fragment=p,
                                step=self.local_step, base_version=state.base_version)

    def _check_history(self, p: int, state: _FragmentState) -> None:
        """The coordinator reports this fragment's version under another commit: it
        lost the one applied here (a failover under async replication, a restored
        state directory) and committed the number again. Take its version now
        rather than train on from a history that is gone. Not in lock-step: applied
        just before a due push, it would leave that push empty, and the round that
        needs it waiting; there every round's pull brings the new history anyway."""
        version, commit_id = self.client.published.get(p, (-1, 0))
        if (self.settings.lockstep or state.pending is not None
                or version != state.base_version
                or 0 in (commit_id, state.base_commit_id) or commit_id == state.base_commit_id):
            return
        self.client.events.emit("version_lost", learner=self.client.learner_id, fragment=p,
                                version=version, had_commit=f"{state.base_commit_id:x}",
                                commit=f"{commit_id:x}")
        state.apply_at, state.fell_back, state.lost_pull = self.local_step + 1, True, True
        state.pushed_at = None  # no push of this learner's waits on this pull
        state.pending = asyncio.run_coroutine_threadsafe(self._pull(p, version - 1), self._loop)

    def _maybe_apply(self, p: int, state: _FragmentState) -> bool:
        if state.pending is None or state.apply_at is None or self.local_step < state.apply_at:
            return False
        if not state.pending.done():
            if not self.settings.lockstep:
                if (not state.fell_back
                        and self.local_step >= state.apply_at + self.settings.overlap_steps):
                    self._fall_back(p, state)
                return False
            waited_from = time.monotonic()
            concurrent.futures.wait([state.pending])
            self._blocked_s += time.monotonic() - waited_from
        pending, state.pending, state.apply_at = state.pending, None, None
        try:
            pulled = pending.result()
        except Exception as exc:  # a failed pull is retried next round
            self.client.events.emit("pull_failed", learner=self.client.learner_id,
                                    fragment=p, error=str(exc)[:200])
            return False
        if pulled is None or not (
                pulled.version > state.base_version or pulled.rewound
                or (pulled.version == state.base_version
                    and pulled.commit_id not in (0, state.base_commit_id))):
            return False
        alpha = self.settings.alpha
        lag = None if state.pushed_at is None else time.monotonic() - state.pushed_at
        with _TRACER.start_as_current_span("ftsync.apply", links=telemetry.links([pulled.trace]),
                                           attributes={"ftsync.learner": self.client.learner_id,
                                                       "ftsync.fragment": p,
                                                       "ftsync.version": pulled.version,
                                                       "ftsync.step": self.local_step}):
            values = (pulled.values if alpha == 0
                      else alpha * self.read(p) + (1 - alpha) * pulled.values)
            self.write(p, values)
        if lag is not None:
            self.client.metrics.apply_lag.record(lag)
        state.pushed_at = None
        state.base = pulled.values
        state.base_version, state.base_commit_id = pulled.version, pulled.commit_id
        state.tokens = state.steps = 0
        state.since, state.blocked_at_since = time.monotonic(), self._blocked_s
        self.applied_versions[p] = pulled.version
        if self.held is not None:
            self.held.applied(p, pulled.version, pulled.commit_id, pulled.values)
        self.client.events.emit("applied", learner=self.client.learner_id, fragment=p,
                                version=pulled.version, step=self.local_step)
        return True

    # -- the background loop ---------------------------------------------------------

    async def _sender(self) -> None:
        assert self._sends is not None
        while True:
            item = await self._sends.get()
            target = None
            try:
                if item.tokens > 0 and item.steps > 0:
                    target = await self.client.push(
                        item.fragment, item.delta, item.base_version, item.tokens, item.steps,
                        item.local_step, work_s=item.work_s)
            except Exception as exc:  # reported; training goes on
                self.client.events.emit("push_failed", learner=self.client.learner_id,
                                        fragment=item.fragment, error=str(exc)[:200])
            finally:
                item.target.set_result(target)
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
