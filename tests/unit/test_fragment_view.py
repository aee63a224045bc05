"""FragmentView: a model's fragments read and written as flat fp32 vectors through host
buffers, pinned and copied on a side stream on CUDA, plain and synchronous on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.fragments import FragmentView, plan_fragments


def small_model() -> torch.nn.Module:
    """Tensors of a few shapes, enough for three fragments."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 48), torch.nn.Linear(48, 16))


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                    reason="no CUDA device here"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_view_round_trips_through_its_host_buffers(device: str, dtype: torch.dtype) -> None:
    model = small_model().to(device=device, dtype=dtype)
    plan = plan_fragments(model, 3)
    view = FragmentView(model, plan)
    assert view.pinned == (device == "cuda")
    rng = np.random.default_rng(0)
    for f in plan.fragments:
        # Values the parameters' dtype holds exactly, so the round trip is bit for bit.
        drawn = torch.from_numpy(rng.standard_normal(f.numel).astype(np.float32))
        values = drawn.to(dtype).to(torch.float32).numpy()
        source = values.copy()
        view.write(f.index, source)
        source[:] = 0  # the caller may reuse its array as soon as write returns
        got = view.read(f.index)
        np.testing.assert_array_equal(got, values)
        got[:] = 7  # a read is the caller's own array
        np.testing.assert_array_equal(view.read(f.index), values)


def test_view_refuses_values_of_another_size_and_writes_nothing() -> None:
    model = small_model()
    plan = plan_fragments(model, 2)
    view = FragmentView(model, plan)
    before = view.read(1)
    with pytest.raises(ValueError, match=f"fragment 1 has {plan.fragments[1].numel} "
                                         f"elements, the values to write have 3"):
        view.write(1, np.zeros(3, np.float32))
    np.testing.assert_array_equal(view.read(1), before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_copies_are_ordered_with_the_training_stream() -> None:
    model = torch.nn.Linear(2048, 2048).cuda()
    plan = plan_fragments(model, 1)
    view = FragmentView(model, plan)
    weight = model.weight
    with torch.no_grad():
        # Queued on the training stream behind a long matmul: the read must see it.
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            x = x @ x / 4096
        weight.fill_(3.0)
    assert (view.read(0)[:weight.numel()] == 3.0).all()
    fresh = np.full(plan.fragments[0].numel, 5.0, np.float32)
    view.write(0, fresh)
    # The training stream's next kernel sees the written values without a host wait.
    assert float(weight.sum()) == 5.0 * weight.numel()
