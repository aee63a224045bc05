"""Validation of settings dataclasses: each `__post_init__` lists its checks as
`(ok, key, problem)` and `check` raises for the first that fails, with a message
that names the key (as the TOML file or the flag spells it), says what is wanted
and shows what was given. Coordinator, learner, harness and simulator settings all
use it, so every bad setting reads the same way. Imports nothing."""

from __future__ import annotations

from collections.abc import Iterable


def check(settings: object, checks: Iterable[tuple[bool, str, str]], prefix: str = "") -> None:
    """`ValueError("<prefix><key> <problem> (got <value>)")` for the first check
    whose `ok` is false; `value` is the field of `settings` named `key`."""
    for ok, key, problem in checks:
        if not ok:
            raise ValueError(f"{prefix}{key} {problem} (got {getattr(settings, key)!r})")
