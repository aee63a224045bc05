"""The built-in torch tasks: names, determinism, shards, and that they learn."""

from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import torch

from learner import tasks
from learner.tasks import Task, task_named

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                   reason="the digits task needs scikit-learn")
ALL_TASKS = [pytest.param("lm-stdlib"), pytest.param("digits", marks=needs_sklearn)]


def tiny(name: str, seed: int = 0) -> Task:
    return task_named(name, seed=seed, size="tiny")


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_unknown_names_and_sizes_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="lm-stdlib, digits"):
        task_named("imagenet")
    with pytest.raises(ValueError, match="tiny, small, base"):
        task_named("lm-stdlib", size="huge")
    with pytest.raises(ValueError, match="batch_size"):
        task_named("lm-stdlib", batch_size=0)
    assert set(tasks.TASKS) == {"lm-stdlib", "digits"}


@pytest.mark.parametrize("name", ALL_TASKS)
def test_bad_shard_is_refused(name: str) -> None:
    task = tiny(name)
    for shard, num_shards in [(4, 4), (-1, 4), (0, 0)]:
        with pytest.raises(ValueError, match="shard"):
            next(task.train_batches(shard, num_shards))


@pytest.mark.parametrize("name", ALL_TASKS)
def test_same_seed_same_weights_and_batches(name: str) -> None:
    a, b = tiny(name, seed=3), tiny(name, seed=3)
    torch.manual_seed(123)  # the global RNG plays no part
    wa = state(a.build_model())
    torch.manual_seed(456)
    expected_draw = torch.rand(4)
    torch.manual_seed(456)
    wb = state(b.build_model())
    # Nor does building take from it: training's own draws stay as they were.
    assert torch.equal(torch.rand(4), expected_draw)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    other = state(tiny(name, seed=4).build_model())
    assert not all(torch.equal(wa[k], other[k]) for k in wa)

    first_a = list(itertools.islice(a.train_batches(1, 4), 3))
    first_b = list(itertools.islice(b.train_batches(1, 4), 3))
    for (xa, ya), (xb, yb) in zip(first_a, first_b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    xc, _ = next(a.train_batches(2, 4))
    assert not torch.equal(first_a[0][0], xc)


def test_lm_batch_shapes_and_token_count() -> None:
    task = task_named("lm-stdlib", size="tiny", batch_size=5)
    inputs, targets = next(task.train_batches(0, 2))
    assert inputs.shape == targets.shape == (5, 32)
    assert inputs.dtype == targets.dtype == torch.int64
    # Targets are the inputs shifted by one byte.
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    loss, tokens = task.loss(task.build_model(), (inputs, targets))
    assert loss.dim() == 0 and tokens == 5 * 32


@needs_sklearn
def test_digits_token_count_is_examples() -> None:
    task = task_named("digits", size="tiny", batch_size=7)
    features, labels = next(task.train_batches(0, 3))
    assert features.shape == (7, 64) and labels.shape == (7,)
    loss, tokens = task.loss(task.build_model(), (features, labels))
    assert loss.dim() == 0 and tokens == 7


def test_lm_shards_are_disjoint_and_never_hold_out_data() -> None:
    task = tiny("lm-stdlib")
    assert isinstance(task, tasks.StdlibLMTask)
    files = tasks.stdlib_files()
    assert len(files) > 100 and list(files) == sorted(files)
    assert not any(part in {"site-packages", "test", "tests"}
                   for f in files for part in f.split("/")[:-1])
    held_out = {f for f in files if tasks.stdlib_shard(f, 4) is None}
    assert 0 < len(held_out) < 0.1 * len(files)
    # The held-out split does not depend on the number of shards.
    assert held_out == {f for f in files if tasks.stdlib_shard(f, 7) is None}
    shards = [set(task.shard_files(s, 4)) for s in range(4)]
    assert all(shards)
    for a, b in itertools.combinations(shards, 2):
        assert not a & b
    assert set(task.held_out_files()) <= held_out
    assert not held_out & set().union(*shards)


@needs_sklearn
def test_digits_shards_are_disjoint_and_never_hold_out_data() -> None:
    task = tiny("digits")
    assert isinstance(task, tasks.DigitsTask)
    held_out = set(task.shard_indices(None, 4).tolist())
    shards = [set(task.shard_indices(s, 4).tolist()) for s in range(4)]
    assert all(shards) and 200 < len(held_out) < 500
    for a, b in itertools.combinations(shards, 2):
        assert not a & b
    assert held_out.isdisjoint(set().union(*shards))
    assert len(held_out) + sum(map(len, shards)) == 1797


def test_lm_initial_loss_is_near_uniform_over_bytes() -> None:
    task = tiny("lm-stdlib")
    assert abs(task.eval_loss(task.build_model()) - math.log(256)) < 0.5


@pytest.mark.parametrize("name", ALL_TASKS)
def test_eval_loss_restores_mode_and_keeps_params(name: str) -> None:
    task = tiny(name)
    model = task.build_model()
    before = state(model)
    first = task.eval_loss(model)
    assert model.training
    model.eval()
    assert task.eval_loss(model) == first
    assert not model.training
    after = state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("name", "steps"), [("lm-stdlib", 60), pytest.param(
    "digits", 40, marks=needs_sklearn)])
def test_a_few_adamw_steps_lower_the_held_out_loss(name: str, steps: int) -> None:
    task = tiny(name)
    model = task.build_model()
    optimizer = task.make_optimizer(model)
    assert isinstance(optimizer, torch.optim.AdamW)
    start = task.eval_loss(model)
    for batch in itertools.islice(task.train_batches(0, 4), steps):
        loss, _ = task.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    end = task.eval_loss(model)
    assert end < start - 1.0, (start, end)


def test_every_size_builds_a_model_that_runs() -> None:
    for size in tasks.SIZES:
        task = task_named("lm-stdlib", size=size, batch_size=2)
        model = task.build_model()
        inputs, targets = next(task.train_batches(0, 8))
        loss, tokens = task.loss(model, (inputs, targets))
        assert math.isfinite(float(loss.detach())) and tokens == targets.numel()
