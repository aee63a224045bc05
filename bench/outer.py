"""Lock-step DiLoCo in one process: which outer step converges at which H.

Four `digits`/small learners (AdamW inner steps, as `ftsync-learner` trains them)
each take H local steps from the global model; their outer gradients are merged
weighted by steps (as `c_tokens · c_tokens / c_steps` weighs equal batches) and the
daemon's own `outer_step` applies them, every round merging every learner at
staleness 0: `step_scale` 1, where the outer settings act exactly as given. No
daemon, no network, no clock: this isolates the outer optimizer from delay.

Per (H, lr, momentum) it prints the global model's held-out loss after `--steps`
inner steps of the fastest learner, and `amplification`: the norm of the applied
outer step over the merged outer gradient's (lr for plain SGD; Nesterov 0.9 climbs
towards 7·lr as rounds with aligned outer gradients add up).

Run from the repository root: `python -m bench.outer [--steps 300]`. The last line
of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from coordinator.config import OuterConfig
from coordinator.merge import outer_step
from learner.tasks import task_named

# Local steps per learner: equal, and as `sync_every = "auto"` assigned them in
# bench/adaptive.py's heterogeneous setting.
SCHEDULES = {"H=5": (5, 5, 5, 5), "H=20": (20, 20, 20, 20), "H=50": (50, 50, 50, 50),
             "H=19,19,6,4": (19, 19, 6, 4)}
OUTERS = {"0.7/0.9 (DiLoCo)": (0.7, 0.9), "0.7/0 (default)": (0.7, 0.0)}


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def load(model: torch.nn.Module, values: np.ndarray) -> None:
    """Copy `values` into `model`'s parameters (they keep their own storage)."""
    with torch.no_grad():
        start = 0
        for p in model.parameters():
            p.copy_(torch.from_numpy(values[start:start + p.numel()]).view_as(p))
            start += p.numel()


def run(hs: tuple[int, ...], outer: OuterConfig, steps: int) -> tuple[float, float]:
    """(held-out loss, mean amplification over the last five rounds)."""
    task = task_named("digits", size="small", seed=0)
    models = [task.build_model() for _ in hs]
    optimizers = [task.make_optimizer(m) for m in models]
    batches = [task.train_batches(i, len(hs)) for i in range(len(hs))]
    params = flat(models[0])
    momentum = np.zeros_like(params)
    amplification = []
    for _ in range(steps // max(hs)):
        merged = np.zeros_like(params)
        for model, optimizer, batch, h in zip(models, optimizers, batches, hs, strict=True):
            load(model, params)
            for _ in range(h):
                loss, _ = task.loss(model, next(batch))
                optimizer.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
            merged += h * (params - flat(model))
        merged /= sum(hs)
        norm = float(np.linalg.norm(merged))
        new = outer_step(outer, params, momentum, merged)
        amplification.append(float(np.linalg.norm(new - params)) / norm)
        params = new
    load(models[0], params)
    return task.eval_loss(models[0]), sum(amplification[-5:]) / len(amplification[-5:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="inner steps of the fastest")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, hs in SCHEDULES.items():
        for label, (lr, mu) in OUTERS.items():
            loss, amp = run(hs, OuterConfig(lr=lr, momentum=mu), args.steps)
            results.setdefault(name, {})[label] = {"eval_loss": round(loss, 3),
                                                   "amplification": round(amp, 2)}
            print(f"{name:12} {label:17} held-out loss {loss:.3f}  amplification {amp:.2f}",
                  file=sys.stderr, flush=True)
    print(json.dumps({"steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
