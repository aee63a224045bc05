"""Unchanged Flower clients run as ftsync learners against a real daemon.

The clients below are written the way Flower's PyTorch tutorials and its
`flwr new` template write them (a `NumPyClient`, and a Message-API
`ClientApp` with `@app.train()` / `@app.evaluate()`); each learner runs in
its own process, `python -m tests.integration.test_flower ...`, and prints
its run summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from learner.client import Refused
from learner.flower import ArrayLayout, FlowerRunSummary, run_client_app, run_numpy_client
from tests.daemon import Daemon, wait_until

ROOT = Path(__file__).resolve().parents[2]
FITS = 5
EXAMPLES = {0: 256, 1: 384}  # per partition: unequal, so the weights tell them apart


# -- a Flower client as the tutorials write it ----------------------------------------------

class Net(nn.Module):
    """Logistic regression on DIM features."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.fc(x)
        return logits.squeeze(-1)


def load_data(partition_id: int, num_examples: int, dim: int = 16,
              ) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """This partition's share of one linearly separable problem (+ a shared test set)."""
    truth = torch.Generator().manual_seed(1234)
    w = torch.randn(dim, generator=truth) * 3 / dim**0.5

    def sample(n: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, dim, generator=g) + 0.5
        return TensorDataset(x, (x @ w > 0).float())

    train = sample(num_examples, 100 + partition_id)
    return (DataLoader(train, batch_size=32, shuffle=True),
            DataLoader(sample(512, 99), batch_size=512))


def train(net: Net, loader: DataLoader[Any], epochs: int, lr: float) -> float:
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    criterion = nn.BCEWithLogitsLoss()
    net.train()
    total = 0.0
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = criterion(net(x), y)
            loss.backward()
            optimizer.step()
            total += loss.item()
    return total / (epochs * len(loader))


def evaluate_net(net: Net, loader: DataLoader[Any]) -> tuple[float, float]:
    criterion = nn.BCEWithLogitsLoss(reduction="sum")
    net.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            logits = net(x)
            loss += criterion(logits, y).item()
            correct += int(((logits > 0).float() == y).sum())
            n += len(y)
    return loss / n, correct / n


def get_weights(net: nn.Module) -> list[np.ndarray]:
    return [val.cpu().numpy() for _, val in net.state_dict().items()]


def set_weights(net: nn.Module, parameters: list[np.ndarray]) -> None:
    params_dict = zip(net.state_dict().keys(), parameters, strict=True)
    state_dict = OrderedDict({k: torch.tensor(v) for k, v in params_dict})
    net.load_state_dict(state_dict, strict=True)


class FlowerClient(NumPyClient):
    def __init__(self, net: Net, trainloader: DataLoader[Any], valloader: DataLoader[Any],
                 local_epochs: int) -> None:
        self.net = net
        self.trainloader = trainloader
        self.valloader = valloader
        self.local_epochs = local_epochs

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return get_weights(self.net)

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any],
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        set_weights(self.net, parameters)
        train_loss = train(self.net, self.trainloader, self.local_epochs, lr=0.1)
        return get_weights(self.net), len(self.trainloader.dataset), {  # type: ignore[arg-type]
            "train_loss": train_loss}

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any],
                 ) -> tuple[float, int, dict[str, Any]]:
        set_weights(self.net, parameters)
        loss, accuracy = evaluate_net(self.net, self.valloader)
        return loss, len(self.valloader.dataset), {"accuracy": accuracy}  # type: ignore[arg-type]


# -- a Message-API ClientApp as `flwr new` writes it ----------------------------------------

app = ClientApp()


@app.train()
def train_fn(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    partition_id = int(context.node_config["partition-id"])
    trainloader, _ = load_data(partition_id, EXAMPLES[partition_id])
    train_loss = train(model, trainloader, int(context.run_config["local-epochs"]), lr=0.1)
    num_examples = len(trainloader.dataset)  # type: ignore[arg-type]
    metrics = MetricRecord({"train_loss": train_loss, "num-examples": num_examples})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate_fn(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    partition_id = int(context.node_config["partition-id"])
    _, valloader = load_data(partition_id, EXAMPLES[partition_id])
    loss, accuracy = evaluate_net(model, valloader)
    num_examples = len(valloader.dataset)  # type: ignore[arg-type]
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy,
                            "num-examples": num_examples})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)


# -- one learner process ----------------------------------------------------------------------

def run_learner(api: str, coordinator: str, learner_id: str, partition: int, fits: int,
                event_log: str = "", dim: int = 16, token: str | None = None,
                ) -> FlowerRunSummary:
    torch.manual_seed(partition)  # each learner offers its own initial model
    common: dict[str, Any] = dict(fits=fits, learner_id=learner_id, fragments=2,
                                  token=token, event_log=event_log, pull_wait_s=20.0,
                                  connect_timeout_s=10.0)
    if api == "app":
        context = Context(run_id=1, node_id=partition + 1, state=RecordDict(),
                          node_config={"partition-id": partition},
                          run_config={"local-epochs": 1})
        return run_client_app(app, coordinator, ArrayRecord(Net(dim).state_dict()),
                              context=context, **common)
    trainloader, valloader = load_data(partition, EXAMPLES[partition], dim)
    client = FlowerClient(Net(dim), trainloader, valloader, local_epochs=1)
    if api == "numpy":
        return run_numpy_client(client, coordinator, **common)
    assert api == "client"
    return run_numpy_client(client.to_client(), coordinator, **common)


def summary_json(summary: FlowerRunSummary) -> dict[str, Any]:
    fields = {k: v for k, v in vars(summary).items() if k != "parameters"}
    decoded: dict[str, Any] = json.loads(json.dumps(fields))
    return decoded


def spawn(api: str, daemon: Daemon, learner_id: str, partition: int,
          event_log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.test_flower", api, daemon.address,
         learner_id, str(partition), str(FITS), str(event_log)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def events(path: Path, kind: str) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


# -- tests ------------------------------------------------------------------------------------

StartDaemon = Callable[..., Daemon]


def test_a_numpy_client_and_a_client_app_train_together_as_learners(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    coordinator_log = tmp_path / "coordinator.jsonl"
    daemon = start_daemon("--min-quorum", "2", "--set", "policy.grace_max_s=0.5",
                          "--event-log", str(coordinator_log))
    learners = {"a": 0, "b": 1}
    # The same model behind both APIs: one layout, so one run.
    processes = {lid: spawn(api, daemon, lid, partition, tmp_path / f"{lid}.jsonl")
                 for (lid, partition), api in zip(learners.items(), ("numpy", "app"),
                                                  strict=True)}
    summaries = {lid: finish(p) for lid, p in processes.items()}

    for lid, s in summaries.items():
        # Both learners end on the same merged model, clearly better than where they began.
        assert s["fits"] == FITS and s["pull_timeouts"] == 0
        assert s["end_loss"] < 0.6 * s["start_loss"], s
        assert s["start_versions"] == {"0": 0, "1": 0}
        assert s["versions"] == {"0": FITS, "1": FITS}
        # Every contribution (one per fragment per fit) merged, none dropped.
        assert s["merged"] == 2 * FITS and s["dropped"] == {} and s["unsettled"] == 0
        assert s["num_examples"] == FITS * EXAMPLES[learners[lid]]
    assert summaries["a"]["start_loss"] == pytest.approx(summaries["b"]["start_loss"])
    assert summaries["a"]["end_loss"] == pytest.approx(summaries["b"]["end_loss"], rel=1e-5)

    status = daemon.status()
    assert {f.fragment: (f.commits, f.merged_contributions) for f in status.fragments} == {
        0: (FITS, 2 * FITS), 1: (FITS, 2 * FITS)}
    assert {learner.learner_id: learner.contributions for learner in status.learners} == {
        "a": 2 * FITS, "b": 2 * FITS}

    # c_tokens = num_examples, c_steps = 1: weight = n·(n/1)·(1 + staleness)^-0.5.
    acks = events(coordinator_log, "push_ack")
    assert len(acks) == 4 * FITS
    for ack in acks:
        n = EXAMPLES[learners[ack["learner"]]]
        assert ack["weight"] == pytest.approx(n * n * (1 + ack["staleness"]) ** -0.5), ack
    assert {ack["learner"]: ack["weight"] for ack in acks if ack["staleness"] == 0} == {
        "a": 256.0**2, "b": 384.0**2}
    fits_logged = events(tmp_path / "a.jsonl", "flower_fit")
    assert [e["fit"] for e in fits_logged] == list(range(1, FITS + 1))


def test_a_learner_with_another_model_is_refused_with_the_reason(
        start_daemon: StartDaemon) -> None:
    daemon = start_daemon("--set", "policy.grace_max_s=0")
    # The first learner (a legacy `Client`, from `to_client()`) sets the run's layout.
    first = run_learner("client", daemon.address, "a", 0, fits=1)
    assert first.versions == {0: 1, 1: 1} and first.merged == 2
    assert first.end_loss is not None and first.start_loss is not None
    assert first.end_loss < first.start_loss
    with pytest.raises(Refused, match="layout"):
        run_learner("numpy", daemon.address, "b", 1, fits=1, dim=8)


def test_a_bad_token_is_refused_with_the_reason(start_daemon: StartDaemon) -> None:
    daemon = start_daemon("--set", 'auth.tokens={a="token-a"}')
    with pytest.raises(Refused, match="token"):
        run_learner("numpy", daemon.address, "a", 0, fits=1, token="not-the-token")


class SlowClient(NumPyClient):
    """Plain numpy; its fit outlasts the coordinator's lease, and it keeps an
    integer counter among its parameters."""

    def __init__(self) -> None:
        self.fitting = threading.Event()
        self.release = threading.Event()

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [np.zeros(8, np.float32), np.zeros(1, np.int64)]

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any],
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        w, fits = parameters
        self.fitting.set()
        assert self.release.wait(30)  # until the test has seen the lease outlast it
        return [w + 1.0, fits + 1], 10, {}


def test_the_lease_holds_through_a_fit_longer_than_it(start_daemon: StartDaemon) -> None:
    # Beats 20 times per lease: a busy machine delays some, never a lease's worth.
    daemon = start_daemon("--set", "heartbeat_interval_ms=100",
                          "--set", "policy.heartbeat_timeout_s=2.0",
                          "--set", "policy.grace_max_s=0")
    client = SlowClient()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_numpy_client, client, daemon.address, fits=1,
                              learner_id="slow", connect_timeout_s=10.0)
        assert client.fitting.wait(10)
        sampling_until = time.monotonic() + 3.0  # the fit outlasts the lease 1.5 times
        try:
            while time.monotonic() < sampling_until:  # sampling, not synchronizing
                assert [(x.learner_id, x.live) for x in daemon.status().learners] == [
                    ("slow", True)]
                time.sleep(0.05)
        finally:
            client.release.set()
        summary = running.result(timeout=20)
    assert summary.start_loss is None and summary.versions == {0: 1}
    # One outer step (lr 0.7, no momentum) on Δ = −1: Θ = 0.7.
    np.testing.assert_allclose(summary.parameters[0], 0.7, rtol=1e-6)
    # The integer counter never travelled: it is the client's own.
    assert summary.parameters[1].dtype == np.int64 and summary.parameters[1].tolist() == [1]
    wait_until(lambda: not daemon.status().learners[0].live, 5, message="the learner left")


class StepClient(NumPyClient):
    """Each fit moves w by -1, at once."""

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [np.zeros(8, np.float32)]

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any],
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        return [parameters[0] - 1.0], 10, {}


def test_fits_whose_merge_is_late_are_each_pushed_once(start_daemon: StartDaemon,
                                                       tmp_path: Path) -> None:
    """No round closes (quorum 2, one learner): every fit's pull times out, and each
    push must carry that fit alone, not again the fits before it."""
    daemon = start_daemon("--min-quorum", "2")
    log = tmp_path / "learner.jsonl"
    summary = run_numpy_client(StepClient(), daemon.address, fits=3, learner_id="a",
                               pull_wait_s=0.3, event_log=str(log), connect_timeout_s=10.0)
    assert summary.pull_timeouts == 3
    # Each pull waited past the version its push was measured from, and none came.
    assert [e["have_version"] for e in events(log, "pull_timeout")] == [0, 0, 0]
    invoked = events(log, "push_invoke")
    assert len(invoked) == 3
    assert [e["c_steps"] for e in invoked] == [1, 1, 1], invoked
    # c_tokens²/c_steps of one fit of 10 examples, at staleness 0.
    assert [e["weight"] for e in events(log, "push_ack")] == [100.0] * 3


class NoExamplesClient(StepClient):
    """Moves w like a StepClient but reports no examples (an empty partition)."""

    def __init__(self) -> None:
        self.fitted = threading.Event()

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any],
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        self.fitted.set()
        return [parameters[0] - 1.0], 0, {}


def test_a_fit_with_no_examples_is_not_pushed_and_takes_the_newest_version(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    """As the schedule says for a push without tokens: not sent, and the learner
    pulls the newest version, here the one another learner's fit made."""
    daemon = start_daemon("--set", "policy.grace_max_s=0")
    log = tmp_path / "empty.jsonl"
    client = NoExamplesClient()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_numpy_client, client, daemon.address, fits=1,
                              learner_id="empty", event_log=str(log), pull_wait_s=30.0,
                              connect_timeout_s=10.0)
        assert client.fitted.wait(30)  # caught up on version 0, its fit done
        other = run_numpy_client(StepClient(), daemon.address, fits=1, learner_id="other",
                                 connect_timeout_s=10.0)
        summary = running.result(timeout=30)
    assert other.versions == {0: 1} and summary.versions == {0: 1}
    assert [e["fit"] for e in events(log, "flower_no_examples")] == [1]
    assert events(log, "push_invoke") == [] and summary.merged == 0
    assert summary.pull_timeouts == 0
    # It ends on version 1, the other learner's fit merged, not on its own fit (w = -1).
    np.testing.assert_array_equal(summary.parameters[0], other.parameters[0])
    assert float(summary.parameters[0][0]) not in (0.0, -1.0)


class GatedClient(StepClient):
    """A StepClient whose every fit waits for the test to let it go."""

    def __init__(self) -> None:
        self.gate = threading.Semaphore(0)
        self.fitting = threading.Event()

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any],
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        self.fitting.set()
        assert self.gate.acquire(timeout=60), "the test never let this fit go"
        self.fitting.clear()
        return super().fit(parameters, config)


def test_a_flower_learner_ahead_of_a_coordinator_that_lost_versions_takes_its_newest(
        start_daemon: StartDaemon, tmp_path: Path) -> None:
    """Restored from an older state directory, the coordinator refuses the push based
    on a version it lost and has nothing newer to pull: the Flower learner takes its
    newest version and its next fits are merged again."""
    state, backup, log = tmp_path / "state", tmp_path / "backup", tmp_path / "a.jsonl"
    daemon = start_daemon("--set", "policy.grace_max_s=0", state_dir=state)
    client = GatedClient()

    def version() -> int:
        return int(daemon.status().fragments[0].version)

    def fit_once(then_version: int) -> None:
        assert client.fitting.wait(30), "no fit under way"
        client.gate.release()
        wait_until(lambda: version() == then_version, 30,
                   message=f"version {then_version}")
        wait_until(client.fitting.is_set, 30, message="the next fit")

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_numpy_client, client, daemon.address, fits=5,
                              learner_id="a", event_log=str(log), pull_wait_s=10.0,
                              connect_timeout_s=30.0)
        assert client.fitting.wait(30)  # joined, version 0 offered, first fit under way
        daemon.stop()
        shutil.copytree(state, backup)
        daemon.start()
        fit_once(then_version=1)
        fit_once(then_version=2)
        daemon.kill()
        shutil.rmtree(state)
        shutil.copytree(backup, state)
        daemon.start()
        assert version() == 0
        client.gate.release()  # fit 3: pushed on version 2, which the coordinator lost
        wait_until(lambda: bool(events(log, "rewound")), 30, message="the rewind")
        fit_once(then_version=1)  # fit 4, on version 0, merged again
        client.gate.release()
        summary = running.result(timeout=30)
    assert summary.versions == {0: 2}
    (rewound,) = events(log, "rewound")
    assert (rewound["had_version"], rewound["version"]) == (2, 0), rewound
    assert summary.dropped == {"future_version": 1}, summary.dropped


class FailingClient(SlowClient):
    def fit(self, parameters: list[np.ndarray], config: dict[str, Any],
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        raise RuntimeError("out of data")


def test_a_failing_fit_leaves_the_run_and_raises(start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    with pytest.raises(RuntimeError, match="out of data"):
        run_numpy_client(FailingClient(), daemon.address, fits=1, learner_id="x")
    assert [(x.learner_id, x.live) for x in daemon.status().learners] == [("x", False)]


@pytest.mark.parametrize(("kwargs", "problem"), [
    ({"fits": 0}, "fits must be at least 1 (got 0)"),
    ({"pull_wait_s": 0.0}, "pull_wait_s must be positive (got 0.0)"),
])
def test_bad_settings_are_refused_before_anything_starts(kwargs: dict[str, Any],
                                                         problem: str) -> None:
    client = StepClient()
    # The address is never dialled: the settings are checked first.
    with pytest.raises(ValueError, match=re.escape(problem)):
        run_numpy_client(client, "127.0.0.1:1", **{"fits": 1, "learner_id": "a", **kwargs})


def test_layout_balances_fragments_and_hashes_the_shapes() -> None:
    arrays: list[np.ndarray] = [np.zeros((64, 32), np.float32), np.zeros(32, np.float64),
              np.zeros((32, 32), np.float32), np.zeros(1, np.int64), np.zeros(1000, np.float32)]
    layout = ArrayLayout.plan(arrays, 2)
    assert layout.fragments == ((0,), (1, 2, 4)) and layout.numels == [2048, 2056]
    assert ArrayLayout.plan(list(arrays), 2).hash == layout.hash
    assert ArrayLayout.plan([*arrays[:4], np.zeros(999, np.float32)], 2).hash != layout.hash
    assert ArrayLayout.plan(arrays, 3).hash != layout.hash
    values = np.arange(2056, dtype=np.float32)
    out = list(arrays)
    layout.write(out, 1, values)
    assert out[1].dtype == np.float64 and out[2].shape == (32, 32)
    np.testing.assert_array_equal(layout.read(out, 1), values)
    with pytest.raises(ValueError, match="4 floating-point arrays into 5"):
        ArrayLayout.plan(arrays, 5)
    with pytest.raises(ValueError, match="keep its shapes"):
        layout.check(arrays[:4], "fit")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one Flower client as an ftsync learner")
    for name in ("api", "coordinator", "learner_id"):
        parser.add_argument(name)
    parser.add_argument("partition", type=int)
    parser.add_argument("fits", type=int)
    parser.add_argument("event_log")
    args = parser.parse_args()
    result = run_learner(args.api, args.coordinator, args.learner_id, args.partition,
                         args.fits, args.event_log)
    print(json.dumps(summary_json(result)))
