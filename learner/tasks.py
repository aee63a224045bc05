"""Built-in torch training tasks, the ones `ftsync-learner --task NAME` runs.

A task owns a model recipe, its inner optimizer, an endless stream of
training batches for one learner's data shard, and a fixed held-out split.
The learner runtime builds the model (every learner gets the same initial
weights from the same seed), steps the inner optimizer on `loss`, counts the
tokens it returns for the synchronizer's weights, and reports `eval_loss`.
Data never comes from the network: `lm-stdlib` trains a byte-level GPT on
the Python standard library's own source files, and `digits` an MLP on the
8×8 digit images that scikit-learn ships. Shards and held-out splits are
chosen by a hash of each item's name or index, so any number of learners
agree on them without talking, and no learner ever trains on held-out data.

The library never sets torch's thread count: the learner process decides.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import importlib
import itertools
import math
import os
import sysconfig
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]

TASKS: tuple[str, ...] = ("lm-stdlib", "digits")
SIZES: tuple[str, ...] = ("tiny", "small", "base")

# Out of every 100 hash buckets, this many are held out from training. For
# lm-stdlib, 4% of the files are about 2% of the bytes (~230 KB of CPython 3.11).
_HELD_OUT_PERCENT = {"lm-stdlib": 4, "digits": 20}


class Task(abc.ABC):
    """One training task, as the learner runtime sees it."""

    name: str

    def __init__(self, *, seed: int, device: str | torch.device) -> None:
        self.seed = seed
        self.device = torch.device(device)

    @property
    @abc.abstractmethod
    def batch_size(self) -> int:
        """Examples (an LM's: windows) in one training step's batch."""

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """The initial model on `device`: the same weights for the same seed, everywhere."""

    @abc.abstractmethod
    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The inner optimizer (AdamW)."""

    @abc.abstractmethod
    def train_batches(self, shard: int, num_shards: int) -> Iterator[Batch]:
        """Endless training batches of one shard, on `device`, fixed by (seed, shard)."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
        """(mean loss as a scalar tensor, tokens in the batch)."""

    @abc.abstractmethod
    def eval_loss(self, model: nn.Module) -> float:
        """Mean cross-entropy (nats) on the fixed held-out split."""


def task_named(name: str, *, seed: int = 0, device: str | torch.device = "cpu",
               size: str = "small", batch_size: int | None = None) -> Task:
    """The built-in task `name` at `size`; ValueError names the valid choices."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(SIZES)}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if name == "lm-stdlib":
        lm = _LM_SIZES[size]
        if batch_size is not None:
            lm = replace(lm, batch=batch_size)
        return StdlibLMTask(lm, seed=seed, device=device)
    mlp = _MLP_SIZES[size]
    if batch_size is not None:
        mlp = replace(mlp, batch=batch_size)
    return DigitsTask(mlp, seed=seed, device=device)


# ---------------------------------------------------------------- shared helpers


def _bucket(key: str) -> int:
    """A stable 64-bit hash (Python's own `hash` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def _shard_of(key: str, num_shards: int, held_out_percent: int) -> int | None:
    """The training shard of `key`, or None if it is held out."""
    h = _bucket(key)
    if h % 100 < held_out_percent:
        return None
    return (h // 100) % num_shards


def _check_shard(shard: int, num_shards: int) -> None:
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"need 0 <= shard < num_shards, got shard {shard} of {num_shards}")


def _rng(seed: int, shard: int, num_shards: int) -> np.random.Generator:
    return np.random.default_rng([seed, shard, num_shards])


M = TypeVar("M", bound=nn.Module)


def _on_cpu_off_the_global_rng(factory: Callable[[], M]) -> M:
    """Build modules on the CPU whose default initialisation the caller overwrites,
    leaving the global RNG as it was, so a task's model depends on its seed alone and
    training draws the same random numbers however the model was built."""
    with torch.random.fork_rng(devices=[]):
        return factory()


def _init_weights(model: nn.Module, seed: int, residual_std: float = 0.02) -> None:
    """Initialise every parameter from a private generator: the global RNG is untouched."""
    generator = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = residual_std if name.endswith("out_proj") else 0.02
            nn.init.normal_(module.weight, std=std, generator=generator)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02, generator=generator)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def import_dynamo_aside() -> threading.Thread:
    """Import `torch._dynamo` (2-5 s here) in a thread, beside a learner's join.

    Every optimizer step imports it (`torch.optim` marks steps for dynamo), and so
    does an optimizer's construction: torch wraps `add_param_group` and a few
    other methods in `torch._disable_dynamo`, which imports all of dynamo on the
    first call only to mark the method as not to be compiled. Marking those
    methods here lets the optimizer be built at once, and the import goes on while
    the learner joins and catches up; join the thread before the first step. For
    processes that never compile, such as `ftsync-learner`: with `torch.compile`
    in play the marks matter."""
    marker = torch._compile._disable_dynamo(lambda: None).__code__
    for klass in (torch.optim.Optimizer, *torch.optim.Optimizer.__subclasses__()):
        for attribute in vars(klass).values():
            wrapped = getattr(attribute, "__wrapped__", None)
            if wrapped is not None and getattr(attribute, "__code__", None) is marker:
                wrapped.__dynamo_disable = wrapped
    thread = threading.Thread(target=importlib.import_module, args=("torch._dynamo",),
                              name="import-dynamo", daemon=True)
    thread.start()
    return thread


def _adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    # Decay matrices only: biases, norms and vectors keep their scale.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    keep = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


# ---------------------------------------------------------------- lm-stdlib


@dataclass(frozen=True)
class LMConfig:
    d_model: int
    layers: int
    heads: int
    context: int
    batch: int
    lr: float
    # Bytes of source read per training shard (files picked in hash order):
    # reading is fast, but one shard needs no more than this to train on.
    max_shard_bytes: int
    eval_windows: int
    weight_decay: float = 0.1


_LM_SIZES = {
    "tiny": LMConfig(d_model=32, layers=1, heads=2, context=32, batch=8, lr=3e-3,
                     max_shard_bytes=1 << 20, eval_windows=64),
    "small": LMConfig(d_model=96, layers=2, heads=4, context=64, batch=16, lr=3e-3,
                      max_shard_bytes=4 << 20, eval_windows=256),
    "base": LMConfig(d_model=384, layers=6, heads=6, context=256, batch=32, lr=1e-3,
                     max_shard_bytes=64 << 20, eval_windows=1024),
}

# Tests and vendored copies of third-party code are not the stdlib's own voice.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=4)
def stdlib_files(root: Path | None = None) -> tuple[str, ...]:
    """Relative POSIX paths of the stdlib's `*.py` files, sorted."""
    root = root or stdlib_root()
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return tuple(sorted(found))


def stdlib_shard(path: str, num_shards: int) -> int | None:
    """The training shard of a stdlib file, or None for the held-out split."""
    return _shard_of(path, num_shards, _HELD_OUT_PERCENT["lm-stdlib"])


@functools.lru_cache(maxsize=16)
def _read_corpus(root: Path, paths: tuple[str, ...]) -> np.ndarray:
    # A blank line between files, so a window that straddles two still reads as code.
    return np.frombuffer(b"\n\n".join((root / p).read_bytes() for p in paths), dtype=np.uint8)


class _Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_out_proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp_in = nn.Linear(d_model, 4 * d_model)
        self.mlp_out_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out_proj(y.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp_out_proj(F.gelu(self.mlp_in(self.ln2(x))))
        return out


class ByteGPT(nn.Module):
    """A small pre-LN causal transformer over bytes, output head tied to the embedding."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(256, config.d_model)
        self.position = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(_Block(config.d_model, config.heads)
                                    for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.token.weight)


class StdlibLMTask(Task):
    """Next-byte prediction on the Python standard library's source."""

    name = "lm-stdlib"

    def __init__(self, config: LMConfig, *, seed: int = 0,
                 device: str | torch.device = "cpu", root: Path | None = None) -> None:
        super().__init__(seed=seed, device=device)
        if config.d_model % config.heads:
            raise ValueError(f"d_model {config.d_model} is not a multiple of heads "
                             f"{config.heads}")
        self.config = config
        self.root = root or stdlib_root()

    @property
    def batch_size(self) -> int:
        return self.config.batch

    def _capped(self, paths: list[str]) -> list[str]:
        # Hash order, not name order, so a capped shard samples the whole stdlib.
        chosen: list[str] = []
        total = 0
        for path in sorted(paths, key=_bucket):
            if total >= self.config.max_shard_bytes:
                break
            chosen.append(path)
            total += (self.root / path).stat().st_size
        return sorted(chosen)

    def shard_files(self, shard: int, num_shards: int) -> list[str]:
        """The files shard `shard` of `num_shards` trains on."""
        _check_shard(shard, num_shards)
        return self._capped([p for p in stdlib_files(self.root)
                             if stdlib_shard(p, num_shards) == shard])

    def held_out_files(self) -> list[str]:
        return self._capped([p for p in stdlib_files(self.root)
                             if stdlib_shard(p, 1) is None])

    def _corpus(self, paths: list[str]) -> np.ndarray:
        data = _read_corpus(self.root, tuple(paths))
        if len(data) <= self.config.context + 1:
            raise ValueError(f"{len(paths)} stdlib files under {self.root} hold only "
                             f"{len(data)} bytes, not enough for one window")
        return data

    def build_model(self) -> nn.Module:
        model = _on_cpu_off_the_global_rng(lambda: ByteGPT(self.config))
        _init_weights(model, self.seed,
                      residual_std=0.02 / math.sqrt(2 * self.config.layers))
        return model.to(self.device)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return _adamw(model, self.config.lr, self.config.weight_decay)

    def _windows(self, data: np.ndarray, starts: np.ndarray) -> Batch:
        span = starts[:, None] + np.arange(self.config.context + 1)
        windows = torch.from_numpy(data[span].astype(np.int64)).to(self.device)
        return windows[:, :-1], windows[:, 1:]

    def train_batches(self, shard: int, num_shards: int) -> Iterator[Batch]:
        data = self._corpus(self.shard_files(shard, num_shards))
        rng = _rng(self.seed, shard, num_shards)
        high = len(data) - self.config.context
        while True:
            yield self._windows(data, rng.integers(0, high, size=self.config.batch))

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
        inputs, targets = batch
        logits: torch.Tensor = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), targets.numel()

    @functools.cached_property
    def _eval_batches(self) -> list[Batch]:
        # Evenly spaced windows: the same held-out bytes for every learner and every call.
        data = self._corpus(self.held_out_files())
        starts = np.linspace(0, len(data) - self.config.context - 1,
                             self.config.eval_windows).astype(np.int64)
        return [self._windows(data, starts[i:i + self.config.batch])
                for i in range(0, len(starts), self.config.batch)]

    def eval_loss(self, model: nn.Module) -> float:
        return _mean_eval_loss(self, model, self._eval_batches)


def _mean_eval_loss(task: Task, model: nn.Module, batches: list[Batch]) -> float:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            total = 0.0
            count = 0
            for batch in batches:
                loss, tokens = task.loss(model, batch)
                total += float(loss) * tokens
                count += tokens
        return total / count
    finally:
        model.train(was_training)


# ---------------------------------------------------------------- digits


@dataclass(frozen=True)
class MLPConfig:
    hidden: tuple[int, ...]
    batch: int
    lr: float
    weight_decay: float = 0.01


_MLP_SIZES = {
    "tiny": MLPConfig(hidden=(32,), batch=32, lr=1e-2),
    "small": MLPConfig(hidden=(128, 128), batch=32, lr=3e-3),
    "base": MLPConfig(hidden=(512, 512), batch=64, lr=1e-3),
}


@functools.lru_cache(maxsize=1)
def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        # Imported by name: scikit-learn ships no type information.
        datasets = importlib.import_module("sklearn.datasets")
    except ImportError as exc:
        raise ImportError("the 'digits' task reads the data set that scikit-learn ships: "
                          "pip install scikit-learn") from exc
    features, labels = datasets.load_digits(return_X_y=True)
    # Pixels are 0..16; centre them so the first layer starts well conditioned.
    return ((features / 16.0 - 0.5).astype(np.float32), labels.astype(np.int64))


def digits_shard(index: int, num_shards: int) -> int | None:
    """The training shard of example `index`, or None for the held-out split."""
    return _shard_of(f"digits/{index}", num_shards, _HELD_OUT_PERCENT["digits"])


class DigitsTask(Task):
    """Classify scikit-learn's 1797 8×8 handwritten digits with an MLP."""

    name = "digits"

    def __init__(self, config: MLPConfig, *, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        super().__init__(seed=seed, device=device)
        self.config = config

    @property
    def batch_size(self) -> int:
        return self.config.batch

    def shard_indices(self, shard: int | None, num_shards: int) -> np.ndarray:
        """Example indices of a training shard, or of the held-out split for None."""
        if shard is not None:
            _check_shard(shard, num_shards)
        labels = _load_digits()[1]
        return np.array([i for i in range(len(labels)) if digits_shard(i, num_shards) == shard],
                        dtype=np.int64)

    def _tensors(self, indices: np.ndarray) -> Batch:
        features, labels = _load_digits()
        return (torch.from_numpy(features[indices]).to(self.device),
                torch.from_numpy(labels[indices]).to(self.device))

    def build_model(self) -> nn.Module:
        widths = (64, *self.config.hidden)

        def mlp() -> nn.Sequential:
            layers: list[nn.Module] = []
            for a, b in itertools.pairwise(widths):
                layers += [nn.Linear(a, b), nn.GELU()]
            return nn.Sequential(*layers, nn.Linear(widths[-1], 10))

        model = _on_cpu_off_the_global_rng(mlp)
        # Fan-in scaled (the 0.02 of transformers would starve a narrow MLP).
        generator = torch.Generator().manual_seed(self.seed)
        for module in model:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=module.in_features**-0.5, generator=generator)
                nn.init.zeros_(module.bias)
        return model.to(self.device)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return _adamw(model, self.config.lr, self.config.weight_decay)

    def train_batches(self, shard: int, num_shards: int) -> Iterator[Batch]:
        features, labels = self._tensors(self.shard_indices(shard, num_shards))
        count = len(labels)
        if count == 0:
            raise ValueError(f"digits shard {shard} of {num_shards} holds no examples")
        rng = _rng(self.seed, shard, num_shards)
        while True:
            picks = rng.choice(count, size=self.config.batch, replace=count < self.config.batch)
            index = torch.from_numpy(picks).to(self.device)
            yield features[index], labels[index]

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
        features, labels = batch
        logits: torch.Tensor = model(features)
        return F.cross_entropy(logits, labels), labels.numel()

    @functools.cached_property
    def _eval_batches(self) -> list[Batch]:
        return [self._tensors(self.shard_indices(None, 1))]

    def eval_loss(self, model: nn.Module) -> float:
        return _mean_eval_loss(self, model, self._eval_batches)
