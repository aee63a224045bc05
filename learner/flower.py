"""Run an unchanged Flower client as an ftsync learner.

A Flower client trains in rounds: it is handed the global parameters, fits
them on its own data and returns new parameters with the number of examples
it used. Here each fit is one outer step of a learner: its parameter list
(the floating-point arrays of it) is bin-packed into fragments, and after
each fit the outer gradient `Δ = Θ_base − θ` of every fragment goes to the
synchronizer with `c_tokens = num_examples` and `c_steps = 1`; the next fit
starts from the merged fragments (or, if no newer version came within the
pull wait, from the learner's own parameters, and the next push carries the
next fit's progress only, as the streaming runtime's does).

Three client shapes run unchanged: a `NumPyClient`, a legacy `Client`
(e.g. `NumPyClient.to_client()`), and a Message-API `ClientApp` whose
`@app.train()` (and optionally `@app.evaluate()`) functions exchange
`"arrays"` / `"config"` / `"metrics"` records the way Flower's own
strategies do, with the example count under `"num-examples"`. A `ClientApp`
built from a legacy `client_fn` is not one of them: pass `client_fn(context)`
to `run_numpy_client` instead.

Called by user scripts and `tests/integration/test_flower.py`; it drives
`learner.client.SynchronizerClient` on its own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from flwr.app import (
    DEFAULT_TTL,
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.client import Client, NumPyClient
from flwr.clientapp import ClientApp
from flwr.common import (
    Code,
    EvaluateIns,
    FitIns,
    GetParametersIns,
    NDArray,
    NDArrays,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)

from learner.client import Pulled, Retry, SynchronizerClient
from learner.fragments import pack_balanced
from protos.events import EventLog
from protos.tls import TlsConfig
from protos.tls import load as load_tls

Metrics = dict[str, Scalar]

# The keys Flower's Message-API strategies (FedAvg and friends) use.
ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
NUM_EXAMPLES_KEY = "num-examples"
ROUND_KEY = "server-round"


# -- the layout: which arrays travel in which fragment ----------------------------------

@dataclass(frozen=True)
class ArrayLayout:
    """A parameter list split into fragments, the same way on every learner.

    Floating-point arrays are bin-packed greedily (largest first, into the
    lightest fragment; ties by list position) as in `learner.fragments`, by
    their fp32 wire size. Other arrays (step counters such as BatchNorm's
    `num_batches_tracked`) stay local: averaging them means nothing. The
    hash covers positions, shapes and dtypes, not names, so a `NumPyClient`
    and a `ClientApp` of the same model can train together."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype[np.generic], ...]
    fragments: tuple[tuple[int, ...], ...]
    hash: str

    @classmethod
    def plan(cls, arrays: Sequence[NDArray], count: int) -> ArrayLayout:
        # Sized by their fp32 wire bytes: that is what a fragment carries.
        members = pack_balanced({i: a.size * 4 for i, a in enumerate(arrays)
                                 if np.issubdtype(a.dtype, np.floating)}, count,
                                "floating-point arrays")
        shapes = tuple(tuple(int(n) for n in a.shape) for a in arrays)
        dtypes = tuple(a.dtype for a in arrays)
        digest = hashlib.sha256(b"flower-ndarrays;")
        for p, indices in enumerate(members):
            for i in sorted(indices):
                digest.update(f"{p}:{i}:{shapes[i]}:{dtypes[i].str};".encode())
        return cls(shapes, dtypes, tuple(tuple(sorted(m)) for m in members),
                   digest.hexdigest()[:16])

    @property
    def numels(self) -> list[int]:
        return [sum(int(np.prod(self.shapes[i])) for i in f) for f in self.fragments]

    def check(self, arrays: Sequence[NDArray], what: str) -> None:
        """Refuse a parameter list whose arrays differ from the planned ones."""
        got = [(tuple(int(n) for n in a.shape), a.dtype) for a in arrays]
        want = list(zip(self.shapes, self.dtypes, strict=True))
        if got != want:
            raise ValueError(f"{what} returned {len(got)} arrays {got}, expected "
                             f"{len(want)} arrays {want}: the model must keep its shapes")

    def read(self, arrays: Sequence[NDArray], p: int) -> np.ndarray:
        """Fragment `p` of `arrays` as one flat fp32 vector."""
        return np.concatenate([np.asarray(arrays[i], dtype=np.float32).reshape(-1)
                               for i in self.fragments[p]])

    def write(self, arrays: list[NDArray], p: int, values: np.ndarray) -> None:
        """Put fragment `p` from a flat vector back into `arrays`, in their dtypes."""
        offset = 0
        for i in self.fragments[p]:
            n = int(np.prod(self.shapes[i]))
            arrays[i] = values[offset:offset + n].reshape(self.shapes[i]).astype(self.dtypes[i])
            offset += n


# -- the client shapes ---------------------------------------------------------------------

class Trainer(Protocol):
    """What the round loop needs from a Flower client, whatever its API."""

    def initial(self, config: Metrics) -> NDArrays: ...

    def fit(self, arrays: NDArrays, config: Metrics) -> tuple[NDArrays, int, Metrics]: ...

    def evaluate(self, arrays: NDArrays, config: Metrics) -> tuple[float, Metrics] | None:
        """(loss, metrics), or None when the client does not evaluate."""
        ...


@dataclass
class NumPyTrainer:
    client: NumPyClient

    def initial(self, config: Metrics) -> NDArrays:
        return self.client.get_parameters(config)

    def fit(self, arrays: NDArrays, config: Metrics) -> tuple[NDArrays, int, Metrics]:
        return self.client.fit(arrays, config)

    def evaluate(self, arrays: NDArrays, config: Metrics) -> tuple[float, Metrics] | None:
        if type(self.client).evaluate is NumPyClient.evaluate:
            return None
        loss, _, metrics = self.client.evaluate(arrays, config)
        return float(loss), metrics


@dataclass
class LegacyClientTrainer:
    """A `flwr.client.Client` (what `NumPyClient.to_client()` and `client_fn` return)."""

    client: Client

    def initial(self, config: Metrics) -> NDArrays:
        res = self.client.get_parameters(GetParametersIns(config))
        _check_status(res.status.code, res.status.message, "get_parameters")
        return parameters_to_ndarrays(res.parameters)

    def fit(self, arrays: NDArrays, config: Metrics) -> tuple[NDArrays, int, Metrics]:
        res = self.client.fit(FitIns(ndarrays_to_parameters(arrays), config))
        _check_status(res.status.code, res.status.message, "fit")
        return parameters_to_ndarrays(res.parameters), res.num_examples, res.metrics

    def evaluate(self, arrays: NDArrays, config: Metrics) -> tuple[float, Metrics] | None:
        if type(self.client).evaluate is Client.evaluate:
            return None
        res = self.client.evaluate(EvaluateIns(ndarrays_to_parameters(arrays), config))
        if res.status.code == Code.EVALUATE_NOT_IMPLEMENTED:
            return None
        _check_status(res.status.code, res.status.message, "evaluate")
        return float(res.loss), res.metrics


def _check_status(code: Code, message: str, call: str) -> None:
    if code != Code.OK:
        raise RuntimeError(f"Flower client {call} failed: {code.name}: {message}")


@dataclass
class ClientAppTrainer:
    """A Message-API `ClientApp`, called with messages built here as a SuperNode would."""

    app: ClientApp
    initial_arrays: ArrayRecord
    context: Context
    loss_key: str = "eval_loss"
    _sent: itertools.count[int] = field(default_factory=itertools.count)

    def initial(self, config: Metrics) -> NDArrays:
        return [array.numpy() for array in self.initial_arrays.values()]

    def fit(self, arrays: NDArrays, config: Metrics) -> tuple[NDArrays, int, Metrics]:
        reply = self._call(MessageType.TRAIN, arrays, config)
        records = reply.array_records
        if ARRAYS_KEY not in records and len(records) != 1:
            raise ValueError(f"the train reply must hold one ArrayRecord (under "
                             f"{ARRAYS_KEY!r}), got {sorted(records)}")
        record = records[ARRAYS_KEY] if ARRAYS_KEY in records else next(iter(records.values()))
        names = list(self.initial_arrays.keys())
        # By name when the app kept them (a torch state dict), else by position.
        order = names if set(record.keys()) == set(names) else list(record.keys())
        metrics = _metrics(reply)
        examples = metrics.pop(NUM_EXAMPLES_KEY, None)
        if not isinstance(examples, int | float):
            raise ValueError(f"the train reply's MetricRecord must hold {NUM_EXAMPLES_KEY!r} "
                             f"(the example count ftsync weighs contributions by)")
        return [record[name].numpy() for name in order], int(examples), metrics

    def evaluate(self, arrays: NDArrays, config: Metrics) -> tuple[float, Metrics] | None:
        try:
            reply = self._call(MessageType.EVALUATE, arrays, config)
        except ValueError as exc:
            if str(exc).startswith("No evaluate function registered"):
                return None
            raise
        metrics = _metrics(reply)
        metrics.pop(NUM_EXAMPLES_KEY, None)
        loss = metrics.get(self.loss_key)
        if not isinstance(loss, int | float):
            raise ValueError(f"the evaluate reply's MetricRecord has no {self.loss_key!r}; "
                             f"pass loss_key= to name the loss")
        return float(loss), metrics

    def _call(self, message_type: str, arrays: NDArrays, config: Metrics) -> RecordDict:
        names = list(self.initial_arrays.keys())
        record = ArrayRecord({name: Array(np.ascontiguousarray(a))
                              for name, a in zip(names, arrays, strict=True)})
        round_ = config.get(ROUND_KEY, 0)
        metadata = Metadata(
            run_id=self.context.run_id, message_id=f"ftsync-{next(self._sent)}",
            src_node_id=0, dst_node_id=self.context.node_id, reply_to_message_id="",
            group_id=str(round_), created_at=time.time(), ttl=DEFAULT_TTL,
            message_type=message_type)
        content = RecordDict({ARRAYS_KEY: record, CONFIG_KEY: ConfigRecord(dict(config))})
        # This process plays the SuperNode, so the message carries the metadata a SuperNode
        # delivers: the exported Message and Metadata, Message taking `metadata=` as
        # Flower's own infrastructure does. Its documented instruction signature,
        # Message(content, dst_node_id, message_type), would read the run and node ids
        # of a Flower task process (TaskIdentity), which this one is not; the typed
        # overloads leave `metadata=` out, hence the ignore. Tested with flwr 1.42
        # (pyproject pins that range).
        message = Message(content=content, metadata=metadata)  # type: ignore[call-overload]
        reply = self.app(message, self.context)
        if reply.has_error():
            raise RuntimeError(f"ClientApp {message_type} failed: {reply.error.code}: "
                               f"{reply.error.reason}")
        return reply.content


def _metrics(content: RecordDict) -> Metrics:
    records = content.metric_records
    record: MetricRecord | None = records.get(METRICS_KEY)
    if record is None and len(records) == 1:
        record = next(iter(records.values()))
    if record is None:
        return {}
    return {k: v for k, v in record.items() if isinstance(v, int | float)}


# -- the round loop ------------------------------------------------------------------------

@dataclass(frozen=True)
class FlowerRunSummary:
    """What a learner's run did. Losses and metrics are the client's own
    evaluate on the first and last global parameters (None / {} when it
    does not evaluate); `versions` per fragment; `merged`/`dropped` count
    this learner's contributions as the coordinator settled them (dropped by
    reason), `unsettled` those still unconfirmed at the end; `parameters`
    is the final parameter list."""

    learner_id: str
    rounds: int
    num_examples: int
    start_loss: float | None
    end_loss: float | None
    start_metrics: Metrics
    end_metrics: Metrics
    fit_metrics: list[Metrics]
    start_versions: dict[int, int]
    versions: dict[int, int]
    merged: int
    dropped: dict[str, int]
    unsettled: int
    pull_timeouts: int
    parameters: NDArrays = field(repr=False)


@dataclass(frozen=True)
class RunSettings:
    rounds: int
    learner_id: str
    fragments: int = 1
    config: Metrics = field(default_factory=dict)
    token: str | None = None
    compression: str = "fp32"
    event_log: str = ""
    evaluate: bool = True
    pull_wait_s: float = 60.0
    connect_timeout_s: float = 60.0
    tls: TlsConfig | None = None

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")
        if self.pull_wait_s <= 0:
            raise ValueError(f"pull_wait_s must be positive, got {self.pull_wait_s}")


def run_numpy_client(client: NumPyClient | Client, coordinator: str, *, rounds: int,
                     learner_id: str, fragments: int = 1, config: Metrics | None = None,
                     token: str | None = None, compression: str = "fp32",
                     event_log: str = "", evaluate: bool = True, pull_wait_s: float = 60.0,
                     connect_timeout_s: float = 60.0,
                     tls: TlsConfig | None = None) -> FlowerRunSummary:
    """Train `client` for `rounds` fits as learner `learner_id` of the run at
    `coordinator`. Each fit gets `config` plus `"server-round"`; evaluation
    (when `evaluate` and the client implements it) runs on the first and the
    last global parameters. Raises `learner.client.Refused` with the
    coordinator's message when it refuses the layout or the token."""
    trainer: Trainer = (NumPyTrainer(client) if isinstance(client, NumPyClient)
                        else LegacyClientTrainer(client))
    return run_trainer(trainer, coordinator, RunSettings(
        rounds, learner_id, fragments, dict(config or {}), token, compression, event_log,
        evaluate, pull_wait_s, connect_timeout_s, tls))


def run_client_app(app: ClientApp, coordinator: str, initial_arrays: ArrayRecord | NDArrays,
                   *, rounds: int, learner_id: str, fragments: int = 1,
                   config: Metrics | None = None, context: Context | None = None,
                   loss_key: str = "eval_loss", token: str | None = None,
                   compression: str = "fp32", event_log: str = "", evaluate: bool = True,
                   pull_wait_s: float = 60.0,
                   connect_timeout_s: float = 60.0,
                   tls: TlsConfig | None = None) -> FlowerRunSummary:
    """Train a Message-API `ClientApp` as a learner. `initial_arrays` plays the
    ServerApp's `initial_arrays` (offered as version 0; the first learner's
    wins); `context` (one for the whole run, so `context.state` persists
    across rounds) carries the `run_config` and `node_config` the app reads.
    The evaluate reply's loss is read from its metrics under `loss_key`."""
    record = (initial_arrays if isinstance(initial_arrays, ArrayRecord)
              else ArrayRecord(numpy_ndarrays=list(initial_arrays)))
    trainer = ClientAppTrainer(app, record, context or Context(
        run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}), loss_key)
    return run_trainer(trainer, coordinator, RunSettings(
        rounds, learner_id, fragments, dict(config or {}), token, compression, event_log,
        evaluate, pull_wait_s, connect_timeout_s, tls))


def run_trainer(trainer: Trainer, coordinator: str, settings: RunSettings) -> FlowerRunSummary:
    """The round loop for any client shape (blocking; runs its own event loop)."""
    events = EventLog(settings.event_log, source=settings.learner_id)
    try:
        return asyncio.run(_Rounds(trainer, coordinator, settings, events).run())
    finally:
        events.close()


@dataclass
class _FragmentState:
    base: np.ndarray
    base_version: int
    tokens: int = 0
    steps: int = 0


class _Rounds:
    def __init__(self, trainer: Trainer, coordinator: str, settings: RunSettings,
                 events: EventLog) -> None:
        self.trainer = trainer
        self.settings = settings
        self.events = events
        self.arrays = list(trainer.initial(dict(settings.config)))
        self.layout = ArrayLayout.plan(self.arrays, settings.fragments)
        self.client = SynchronizerClient(
            coordinator, settings.learner_id, self.layout.hash, self.layout.numels,
            token=settings.token, codec=settings.compression,
            retry=Retry(give_up_after_s=settings.connect_timeout_s), events=events,
            tls=load_tls(settings.tls))
        self.states: list[_FragmentState] = []
        self.completed = 0
        self.pull_timeouts = 0

    async def run(self) -> FlowerRunSummary:
        beating: asyncio.Task[None] | None = None
        reason = "done"
        try:
            await self._start()
            beating = asyncio.create_task(self._heartbeats(), name="heartbeats")
            return await self._rounds()
        except BaseException as exc:
            reason = f"error: {exc!r}"[:200]
            raise
        finally:
            if beating is not None:
                beating.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beating
            if self.client.may_be_member:
                # A learner that is gone must not hold the others' rounds.
                await self.client.leave(reason)
            await self.client.close()

    async def _start(self) -> None:
        response = await self.client.join()
        for status in response.fragments:
            if status.version < 0:
                await self.client.push_initial(status.fragment,
                                               self.layout.read(self.arrays, status.fragment))
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.settings.connect_timeout_s
        snapshot: dict[int, Pulled] = {}
        while len(snapshot) < len(self.layout.fragments):
            snapshot = await self.client.snapshot()
            if len(snapshot) < len(self.layout.fragments):
                if loop.time() > give_up:
                    raise TimeoutError("fragments still have no initial value after "
                                       f"{self.settings.connect_timeout_s}s")
                await asyncio.sleep(0.1)  # another learner is still pushing its init
        for p in range(len(self.layout.fragments)):
            pulled = snapshot[p]
            self.layout.write(self.arrays, p, pulled.values)
            self.states.append(_FragmentState(pulled.values.copy(), pulled.version))

    async def _rounds(self) -> FlowerRunSummary:
        start_versions = self._versions()
        start = await self._evaluate(0)
        fit_metrics: list[Metrics] = []
        examples = 0
        for round_ in range(1, self.settings.rounds + 1):
            config = {**self.settings.config, ROUND_KEY: round_}
            started = time.monotonic()
            fitted, num_examples, metrics = await asyncio.to_thread(
                self.trainer.fit, list(self.arrays), config)
            fitted = list(fitted)
            self.layout.check(fitted, "fit")
            fit_s = time.monotonic() - started
            self.arrays = fitted
            self.completed = round_
            examples += num_examples
            fit_metrics.append(metrics)
            targets = await self._push_all(int(num_examples), round_)
            applied = await self._pull_all(targets)
            self.events.emit("flower_round", learner=self.settings.learner_id, round=round_,
                             num_examples=num_examples, fit_s=round(fit_s, 4),
                             applied=applied, versions=self._versions(), metrics=metrics)
        end = await self._evaluate(self.settings.rounds)
        await self._settle()
        return FlowerRunSummary(
            learner_id=self.settings.learner_id, rounds=self.settings.rounds,
            num_examples=examples, start_loss=start[0] if start else None,
            end_loss=end[0] if end else None, start_metrics=start[1] if start else {},
            end_metrics=end[1] if end else {}, fit_metrics=fit_metrics,
            start_versions=start_versions, versions=self._versions(),
            merged=self.client.stats.merged, dropped=dict(self.client.stats.dropped),
            unsettled=self.client.backlog, pull_timeouts=self.pull_timeouts,
            parameters=list(self.arrays))

    async def _push_all(self, num_examples: int, round_: int) -> list[int | None]:
        """Push every fragment; returns the versions the coordinator will merge them into."""
        for state in self.states:
            state.tokens += num_examples
            state.steps += 1
        if num_examples < 1:
            # Nothing to weigh this fit by; its progress rides on the next push.
            self.events.emit("flower_no_examples", learner=self.settings.learner_id,
                             round=round_)
            return [None] * len(self.states)
        current = [self.layout.read(self.arrays, p) for p in range(len(self.states))]
        targets = await asyncio.gather(*(
            self.client.push(p, state.base - current[p], state.base_version, state.tokens,
                             state.steps, round_)
            for p, state in enumerate(self.states)))
        # Pushed: that progress is the synchronizer's now, never to be sent again.
        for state, values in zip(self.states, current, strict=True):
            state.base, state.tokens, state.steps = values, 0, 0
        return targets

    async def _pull_all(self, targets: list[int | None]) -> list[int]:
        """Wait (up to pull_wait_s) for each fragment's version holding this fit, and apply it."""
        pulled = await asyncio.gather(*(
            self.client.pull_newer(p, state.base_version if target is None
                                   else max(state.base_version, target - 1),
                                   self.settings.pull_wait_s)
            for (p, state), target in zip(enumerate(self.states), targets, strict=True)))
        applied = []
        for p, (state, new) in enumerate(zip(self.states, pulled, strict=True)):
            if new is None or (new.version <= state.base_version and not new.rewound):
                # No one merged in time: train on from our own parameters.
                self.pull_timeouts += 1
                self.events.emit("pull_timeout", learner=self.settings.learner_id,
                                 fragment=p, have_version=state.base_version)
                continue
            self.layout.write(self.arrays, p, new.values)
            state.base, state.base_version = new.values.copy(), new.version
            state.tokens = state.steps = 0
            applied.append(p)
        return applied

    async def _evaluate(self, round_: int) -> tuple[float, Metrics] | None:
        if not self.settings.evaluate:
            return None
        config = {**self.settings.config, ROUND_KEY: round_}
        result = await asyncio.to_thread(self.trainer.evaluate, list(self.arrays), config)
        if result is not None:
            self.events.emit("flower_evaluate", learner=self.settings.learner_id,
                             round=round_, loss=result[0], metrics=result[1])
        return result

    async def _settle(self) -> None:
        """Send again what was lost, and learn which contributions were merged."""
        with contextlib.suppress(Exception):
            await self.client.repush_unacknowledged()
            await self.client.heartbeat(self.completed)

    async def _heartbeats(self) -> None:
        # Keeps the lease while a long fit runs, and re-sends lost contributions.
        while True:
            await asyncio.sleep(self.client.heartbeat_interval_s)
            try:
                await self.client.heartbeat(self.completed)
                await self.client.repush_unacknowledged()
            except Exception as exc:  # the next beat tries again
                self.events.emit("heartbeat_failed", learner=self.settings.learner_id,
                                 error=str(exc)[:200])

    def _versions(self) -> dict[int, int]:
        return {p: state.base_version for p, state in enumerate(self.states)}
