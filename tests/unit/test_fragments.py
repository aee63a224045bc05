"""Fragment plans and the streaming schedule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from learner.fragments import FragmentView, plan_fragments
from learner.streaming import due_fragments, lockstep_resume_step, offsets


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


@given(sync_every=st.integers(1, 200), fragments=st.integers(1, 16))
def test_each_fragment_is_due_once_per_window_at_its_offset(sync_every: int,
                                                            fragments: int) -> None:
    starts = offsets(sync_every, fragments)
    assert starts == sorted(starts) and all(0 <= t < sync_every for t in starts)
    for window in range(3):
        due: list[tuple[int, int]] = []
        first = 1 + sync_every + window * sync_every
        for step in range(first, first + sync_every):
            due += [(p, step) for p in due_fragments(step, sync_every, fragments)]
        assert sorted(p for p, _ in due) == list(range(fragments))
        for p, step in due:
            assert (step - starts[p]) % sync_every == 0


def test_fragments_are_staggered_across_the_window() -> None:
    assert offsets(100, 4) == [0, 25, 50, 75]
    assert due_fragments(100, 100, 4) == [0]
    assert due_fragments(125, 100, 4) == [1]
    # Nothing is due before a fragment has had a full window of steps.
    assert due_fragments(25, 100, 4) == []


@given(sync_every=st.integers(1, 60), fragments=st.integers(1, 8), step=st.integers(0, 400))
def test_a_learner_rejoining_lock_step_pushes_each_fragment_for_the_next_version(
        sync_every: int, fragments: int, step: int) -> None:
    """The others are at `step`, every push up to it merged: the rejoining learner's
    next push of fragment p comes at the step they push version v_p + 1."""
    starts = offsets(sync_every, fragments)
    versions = {p: sum(1 for s in range(1, step + 1) if p in due_fragments(s, sync_every,
                                                                             fragments))
                for p in range(fragments)}
    resumed = lockstep_resume_step(versions, sync_every)
    assert resumed <= step
    for p in range(fragments):
        next_push = next(s for s in range(resumed + 1, resumed + 2 * sync_every + 2)
                         if p in due_fragments(s, sync_every, fragments))
        assert next_push == starts[p] + (versions[p] + 1) * sync_every
