"""Fragment plans and the streaming schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from learner.fragments import FragmentView, plan_fragments
from learner.schedule import Push, Schedule, ScheduleConfig, lockstep_resume_step, offsets


def transformer_like(seed: int, width: int = 32, layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width),
                   torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(torch.nn.Embedding(256, width), *blocks)


def test_plan_covers_every_tensor_once_with_balanced_bytes() -> None:
    model = transformer_like(0)
    plan = plan_fragments(model, 4)
    names = [n for f in plan.fragments for n in f.names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    sizes = [f.numel for f in plan.fragments]
    assert sum(sizes) == sum(p.numel() for p in model.parameters())
    largest_tensor = max(p.numel() for p in model.parameters())
    # Greedy largest-first packing: no fragment exceeds another by more than one tensor.
    assert max(sizes) - min(sizes) <= largest_tensor


def test_plan_and_hash_depend_on_shapes_not_values() -> None:
    a, b = plan_fragments(transformer_like(0), 4), plan_fragments(transformer_like(1), 4)
    assert a == b
    assert plan_fragments(transformer_like(0), 3).hash != a.hash
    assert plan_fragments(transformer_like(0, width=48), 4).hash != a.hash


def test_plan_refuses_more_fragments_than_tensors() -> None:
    with pytest.raises(ValueError, match="at most 2"):
        plan_fragments(torch.nn.Linear(3, 3), 3)
    with pytest.raises(ValueError, match="at least 1"):
        plan_fragments(torch.nn.Linear(3, 3), 0)


def test_view_reads_and_writes_flat_fp32_fragments() -> None:
    model = transformer_like(0)
    plan = plan_fragments(model, 3)
    view = FragmentView(model, plan)
    for f in plan.fragments:
        values = view.read(f.index)
        assert values.dtype == np.float32 and values.size == f.numel
        view.write(f.index, values * 2)
        np.testing.assert_array_equal(view.read(f.index), values * 2)
    params = dict(model.named_parameters())
    first = plan.fragments[0].names[0]
    assert params[first].requires_grad and params[first].grad is None


def pushes(sync_every: int, fragments: int, steps: range, lockstep: bool = False,
           versions: dict[int, int] | None = None) -> list[tuple[int, int]]:
    """(fragment, step) of every push the schedule makes over `steps`, started at
    `versions` (all 0 by default) and never answered: when each fragment is due."""
    schedule = Schedule(ScheduleConfig(sync_every=sync_every, fragments=fragments,
                                       lockstep=lockstep))
    schedule.start(versions or dict.fromkeys(range(fragments), 0))
    return [(action.p, k) for k in steps for action in schedule.step(k, tokens=1)
            if isinstance(action, Push)]


@given(sync_every=st.integers(1, 200), fragments=st.integers(1, 16))
def test_each_fragment_is_due_once_per_window_at_its_offset(sync_every: int,
                                                            fragments: int) -> None:
    starts = offsets(sync_every, fragments)
    assert starts == sorted(starts) and all(0 <= t < sync_every for t in starts)
    due = pushes(sync_every, fragments, range(1, 1 + 4 * sync_every))
    for window in range(3):
        first = 1 + sync_every + window * sync_every
        within = [(p, step) for p, step in due if first <= step < first + sync_every]
        assert sorted(p for p, _ in within) == list(range(fragments))
        for p, step in within:
            assert (step - starts[p]) % sync_every == 0


def test_fragments_are_staggered_across_the_window() -> None:
    assert offsets(100, 4) == [0, 25, 50, 75]
    due = pushes(100, 4, range(1, 201))
    assert [step for p, step in due if p == 0] == [100, 200]
    assert [step for p, step in due if p == 1] == [125]
    # Nothing is due before a fragment has had a full window of steps.
    assert min(step for _, step in due) == 100


@given(sync_every=st.integers(1, 60), fragments=st.integers(1, 8), step=st.integers(0, 400))
def test_a_learner_rejoining_lock_step_pushes_each_fragment_for_the_next_version(
        sync_every: int, fragments: int, step: int) -> None:
    """The others are at `step`, every push up to it merged: the rejoining learner's
    next push of fragment p comes at the step they push version v_p + 1."""
    starts = offsets(sync_every, fragments)
    # Pushes of fragment p come at t_p + H, t_p + 2H, ...: one version each.
    versions = {p: max(0, (step - t) // sync_every) for p, t in enumerate(starts)}
    resumed = lockstep_resume_step(versions, sync_every)
    assert resumed <= step
    due = pushes(sync_every, fragments, range(resumed + 1, resumed + 2 * sync_every + 2),
                 lockstep=True, versions=versions)
    for p in range(fragments):
        next_push = min(s for q, s in due if q == p)
        assert next_push == starts[p] + (versions[p] + 1) * sync_every
