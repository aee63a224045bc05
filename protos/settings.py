"""Validation of settings: each dataclass's `__post_init__` lists its checks as
`(ok, key, problem)` and `check` raises for the first that fails, with a message
that names the key (as the TOML file or the flag spells it), says what is wanted
and shows what was given. Coordinator, learner, harness and simulator settings all
use it, so every bad setting reads the same way; `number_or_auto` parses the flags
that take a number or "auto". Imports nothing but argparse."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def check(settings: object, checks: Iterable[tuple[bool, str, str]], prefix: str = "") -> None:
    """`ValueError("<prefix><key> <problem> (got <value>)")` for the first check
    whose `ok` is false; `value` is the field of `settings` named `key`."""
    for ok, key, problem in checks:
        if not ok:
            raise ValueError(f"{prefix}{key} {problem} (got {getattr(settings, key)!r})")


def number_or_auto(what: str) -> Callable[[str], int | str]:
    """An argparse type for a flag that takes a whole number or "auto" (--min-quorum,
    --sync-every); `what` names the number in its error."""
    def parse(text: str) -> int | str:
        if text == "auto":
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {what} or auto (got {text!r})") from None
    return parse
