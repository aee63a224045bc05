"""Run an unchanged Flower client as an ftsync learner.

A Flower client trains in fits: it is handed the global parameters, fits
them on its own data and returns new parameters with the number of examples
it used. Here each fit is one outer step of a learner: its parameter list
(the floating-point arrays of it) is bin-packed into fragments, and each fit
is one step of the learner's schedule (`learner.schedule`, H = 1) driven
through the streaming runtime's shell (`learner.streaming.FragmentSync`):
after each fit the outer gradient `Δ = Θ_base − θ` of every fragment goes to
the synchronizer with `c_tokens = num_examples` and `c_steps = 1`, and the
next fit starts from the merged fragments (or, where no newer version came
within the pull wait, from the learner's own parameters, and the next push
carries the next fit's progress only). A fit with no examples has nothing to
weigh it by and is not pushed; the learner takes the newest version instead.

Three client shapes run unchanged: a `NumPyClient`, a legacy `Client`
(e.g. `NumPyClient.to_client()`), and a Message-API `ClientApp` whose
`@app.train()` (and optionally `@app.evaluate()`) functions exchange
`"arrays"` / `"config"` / `"metrics"` records the way Flower's own
strategies do, with the example count under `"num-examples"`. A `ClientApp`
built from a legacy `client_fn` is not one of them: pass `client_fn(context)`
to `run_numpy_client` instead.

Called by user scripts and `tests/integration/test_flower.py`; the client's
calls run on the calling thread, the network on `FragmentSync`'s loop.
"""

from __future__ import annotations

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

from learner.client import Retry, SynchronizerClient
from learner.fragments import pack_balanced
from learner.streaming import FragmentSync, SyncSettings
from protos.events import EventLog
from protos.settings import check
from protos.tls import TlsConfig
from protos.tls import load as load_tls

Metrics = dict[str, Scalar]

# The keys Flower's Message-API strategies (FedAvg and friends) use.
ARRAYS_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
NUM_EXAMPLES_KEY = "num-examples"
# Flower's own name; each fit gets its number under it, as a server round would.
SERVER_ROUND_KEY = "server-round"


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
    """What the fit loop needs from a Flower client, whatever its API."""

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
        server_round = config.get(SERVER_ROUND_KEY, 0)
        metadata = Metadata(
            run_id=self.context.run_id, message_id=f"ftsync-{next(self._sent)}",
            src_node_id=0, dst_node_id=self.context.node_id, reply_to_message_id="",
            group_id=str(server_round), created_at=time.time(), ttl=DEFAULT_TTL,
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


# -- the fit loop --------------------------------------------------------------------------

@dataclass(frozen=True)
class FlowerRunSummary:
    """What a learner's run did. Losses and metrics are the client's own
    evaluate on the first and last global parameters (None / {} when it
    does not evaluate); `versions` per fragment; `merged`/`dropped` count
    this learner's contributions as the coordinator settled them (dropped by
    reason), `unsettled` those still unconfirmed at the end; `pull_timeouts`
    the pulls that brought no version within `pull_wait_s`; `parameters` is
    the final parameter list."""

    learner_id: str
    fits: int
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
    fits: int
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
        check(self, [(self.fits >= 1, "fits", "must be at least 1"),
                     (self.pull_wait_s > 0, "pull_wait_s", "must be positive")])


def run_numpy_client(client: NumPyClient | Client, coordinator: str, *, fits: int,
                     learner_id: str, fragments: int = 1, config: Metrics | None = None,
                     token: str | None = None, compression: str = "fp32",
                     event_log: str = "", evaluate: bool = True, pull_wait_s: float = 60.0,
                     connect_timeout_s: float = 60.0,
                     tls: TlsConfig | None = None) -> FlowerRunSummary:
    """Train `client` for `fits` fits as learner `learner_id` of the run at
    `coordinator`. Fit n gets `config` plus `"server-round": n`; evaluation
    (when `evaluate` and the client implements it) runs on the first and the
    last global parameters. Raises `learner.client.Refused` with the
    coordinator's message when it refuses the layout or the token."""
    trainer: Trainer = (NumPyTrainer(client) if isinstance(client, NumPyClient)
                        else LegacyClientTrainer(client))
    return run_trainer(trainer, coordinator, RunSettings(
        fits, learner_id, fragments, dict(config or {}), token, compression, event_log,
        evaluate, pull_wait_s, connect_timeout_s, tls))


def run_client_app(app: ClientApp, coordinator: str, initial_arrays: ArrayRecord | NDArrays,
                   *, fits: int, learner_id: str, fragments: int = 1,
                   config: Metrics | None = None, context: Context | None = None,
                   loss_key: str = "eval_loss", token: str | None = None,
                   compression: str = "fp32", event_log: str = "", evaluate: bool = True,
                   pull_wait_s: float = 60.0,
                   connect_timeout_s: float = 60.0,
                   tls: TlsConfig | None = None) -> FlowerRunSummary:
    """Train a Message-API `ClientApp` as a learner. `initial_arrays` plays the
    ServerApp's `initial_arrays` (offered as version 0; the first learner's
    wins); `context` (one for the whole run, so `context.state` persists
    across fits) carries the `run_config` and `node_config` the app reads.
    The evaluate reply's loss is read from its metrics under `loss_key`."""
    record = (initial_arrays if isinstance(initial_arrays, ArrayRecord)
              else ArrayRecord(numpy_ndarrays=list(initial_arrays)))
    trainer = ClientAppTrainer(app, record, context or Context(
        run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}), loss_key)
    return run_trainer(trainer, coordinator, RunSettings(
        fits, learner_id, fragments, dict(config or {}), token, compression, event_log,
        evaluate, pull_wait_s, connect_timeout_s, tls))


def run_trainer(trainer: Trainer, coordinator: str, settings: RunSettings) -> FlowerRunSummary:
    """The fit loop for any client shape (blocking; the client's calls run on the
    calling thread)."""
    events = EventLog(settings.event_log, source=settings.learner_id)
    try:
        return _Fits(trainer, coordinator, settings, events).run()
    finally:
        events.close()


class _Fits:
    """One learner's fits, driving the learner's schedule through the streaming
    shell (`FragmentSync`) with one step per fit and H = 1: after each fit every
    fragment is pushed, and `merge` waits for the versions that merge them and
    applies them before the next fit (or, for a pull that brought nothing, the
    next fit trains on from the learner's own parameters)."""

    def __init__(self, trainer: Trainer, coordinator: str, settings: RunSettings,
                 events: EventLog) -> None:
        self.trainer = trainer
        self.settings = settings
        self.events = events
        self.arrays = list(trainer.initial(dict(settings.config)))
        self.layout = ArrayLayout.plan(self.arrays, settings.fragments)
        client = SynchronizerClient(
            coordinator, settings.learner_id, self.layout.hash, self.layout.numels,
            token=settings.token, codec=settings.compression,
            retry=Retry(give_up_after_s=settings.connect_timeout_s), events=events,
            tls=load_tls(settings.tls))
        # A fit's pushes are all sent before its merge is waited for: none is dropped.
        self.sync = FragmentSync(client, SyncSettings(
            sync_every=1, max_backlog=len(self.layout.fragments),
            pull_wait_s=settings.pull_wait_s), self._read, self._write)

    def _read(self, p: int) -> np.ndarray:
        return self.layout.read(self.arrays, p)

    def _write(self, p: int, values: np.ndarray) -> None:
        self.layout.write(self.arrays, p, values)

    def run(self) -> FlowerRunSummary:
        # The join retries for up to connect_timeout_s, then the initial values may
        # take as long (another learner still offering its own).
        self.sync.start(timeout=2 * self.settings.connect_timeout_s)
        try:
            return self._fits()
        except BaseException as exc:
            # A learner that is gone must not hold the others' rounds.
            self.sync.close(f"error: {exc!r}"[:200])
            raise

    def _fits(self) -> FlowerRunSummary:
        assert self.sync.catch_up is not None
        start_versions = dict(self.sync.catch_up.versions)
        start = self._evaluate(0)
        fit_metrics: list[Metrics] = []
        examples = 0
        for fit in range(1, self.settings.fits + 1):
            started = time.monotonic()
            fitted, num_examples, metrics = self.trainer.fit(
                list(self.arrays), {**self.settings.config, SERVER_ROUND_KEY: fit})
            fitted = list(fitted)
            self.layout.check(fitted, "fit")
            fit_s = time.monotonic() - started
            self.arrays = fitted
            examples += num_examples
            fit_metrics.append(metrics)
            if num_examples < 1:
                # Nothing to weigh it by: the schedule's push of it is not sent.
                self.events.emit("flower_no_examples", learner=self.settings.learner_id,
                                 fit=fit)
            applied = self.sync.step(max(int(num_examples), 0))
            applied += self.sync.merge()
            self.events.emit("flower_fit", learner=self.settings.learner_id, fit=fit,
                             num_examples=num_examples, fit_s=round(fit_s, 4),
                             applied=applied, versions=dict(self.sync.applied_versions),
                             metrics=metrics)
        end = self._evaluate(self.settings.fits)
        self.sync.close()
        stats = self.sync.client.stats
        return FlowerRunSummary(
            learner_id=self.settings.learner_id, fits=self.settings.fits,
            num_examples=examples, start_loss=start[0] if start else None,
            end_loss=end[0] if end else None, start_metrics=start[1] if start else {},
            end_metrics=end[1] if end else {}, fit_metrics=fit_metrics,
            start_versions=start_versions, versions=dict(self.sync.applied_versions),
            merged=stats.merged, dropped=dict(stats.dropped),
            unsettled=self.sync.client.backlog, pull_timeouts=self.sync.pull_timeouts,
            parameters=list(self.arrays))

    def _evaluate(self, fit: int) -> tuple[float, Metrics] | None:
        """The client's evaluate after `fit` fits (0: on the initial global values)."""
        if not self.settings.evaluate:
            return None
        result = self.trainer.evaluate(list(self.arrays),
                                       {**self.settings.config, SERVER_ROUND_KEY: fit})
        if result is not None:
            self.events.emit("flower_evaluate", learner=self.settings.learner_id, fit=fit,
                             loss=result[0], metrics=result[1])
        return result
