"""A learner's outbox: its half of exactly-once, as a pure core.

Every pushed contribution is held here under a seq of its own until a committed
manifest names it (the coordinator's durable merged-seq watermark for its
fragment reaches its seq), and is pushed again when a coordinator comes back
without it. It leaves only as merged, or as dropped with the coordinator's
reason, and each once. Seqs only grow, and a new one is above every watermark
and every `next_seq` a coordinator has reported, so none is reused.

Events in (`add`, `acked`, `refused`, `observe`, `joined`), decisions out
(`Settled`): no grpc, no asyncio, no clock. The RPC client
(`learner.client.SynchronizerClient`) feeds it and says what it decided.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Contribution:
    """One pushed outer gradient, kept until a committed manifest names it."""

    fragment: int
    seq: int
    base_version: int
    c_tokens: int
    c_steps: int
    local_step: int
    delta: np.ndarray
    # Learner time the contribution's steps took (for goodput accounting).
    work_s: float = 0.0
    acknowledged: bool = False
    in_flight: bool = False
    # Under way when the learner joined again: its answer may be the replaced
    # coordinator's, so an acknowledgement of it does not stand.
    joined_meanwhile: bool = False


@dataclass
class OutboxStats:
    merged: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    # Fragment → the version its last acknowledged push merges into.
    pushed: dict[int, int] = field(default_factory=dict)
    repushed: int = 0


@dataclass(frozen=True)
class Settled:
    """A contribution that left the outbox: merged, or dropped with `reason`
    (`seq` None: one dropped before it was sent, so it never took a seq)."""

    fragment: int
    seq: int | None
    merged: bool
    reason: str = ""
    detail: str = ""
    work_s: float = 0.0


class Outbox:
    """The contributions pushed and not yet settled, and how each settles."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int], Contribution] = {}
        # Fragment → the coordinator's durable merged-seq watermark, as last reported.
        self.watermarks: dict[int, int] = {}
        self.stats = OutboxStats()
        self._next_seq = 1

    def __len__(self) -> int:
        return len(self._held)

    def held(self) -> list[Contribution]:
        """The contributions not yet settled, oldest first."""
        return sorted(self._held.values(), key=lambda c: c.seq)

    def holds(self, c: Contribution) -> bool:
        return self._held.get((c.fragment, c.seq)) is c

    def take_seq(self) -> int:
        """A seq never used before (an initial value's push takes one too)."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def add(self, fragment: int, delta: np.ndarray, base_version: int, c_tokens: int,
            c_steps: int, local_step: int, work_s: float = 0.0) -> Contribution:
        """Hold a new contribution under a fresh seq, to be pushed."""
        c = Contribution(fragment, self.take_seq(), base_version, c_tokens, c_steps,
                         local_step, delta, work_s)
        self._held[(fragment, c.seq)] = c
        return c

    def joined(self, next_seq: int) -> None:
        """A coordinator (maybe a new one) took this learner's Join: it holds none
        of the contributions until they are pushed again, and seqs resume at or
        above `next_seq`."""
        self._next_seq = max(self._next_seq, next_seq)
        for c in self._held.values():
            c.acknowledged = False
            c.joined_meanwhile = c.in_flight

    def observe(self, fragment: int, merged_seq: int) -> list[Settled]:
        """The coordinator's durable watermark for `fragment`: every contribution
        at or below it is merged."""
        self.watermarks[fragment] = merged_seq
        # A seq at or below it would be refused as replayed and settled unmerged.
        self._next_seq = max(self._next_seq, merged_seq + 1)
        return [self._settle(c, merged=True) for c in self.held()
                if c.fragment == fragment and c.seq <= merged_seq]

    @contextmanager
    def sending(self, c: Contribution) -> Iterator[None]:
        """`c` is being pushed: not to be pushed again meanwhile."""
        c.in_flight = True
        try:
            yield
        finally:
            c.in_flight = False

    def acked(self, c: Contribution, target_version: int) -> bool:
        """The coordinator holds `c` in the round that commits `target_version`;
        False when the learner joined again while `c` was pushed: the coordinator
        that answered may be the one the join replaced, whose rounds are gone, so `c`
        is to be pushed again (a coordinator that does hold it answers the repeat as
        a replay in its open round)."""
        if c.joined_meanwhile:
            c.joined_meanwhile = False
            self.stats.repushed += 1
            return False
        c.acknowledged = True
        self.stats.pushed[c.fragment] = target_version
        return True

    def refused(self, c: Contribution, reason: str, merged_seq: int,
                detail: str = "") -> Settled | None:
        """The coordinator refused `c` (`merged_seq`: its watermark, as the refusal
        says). A replay at or below the watermark was merged before; a replay above
        it is in the open round (acknowledged, None); anything else drops it.
        None too for one settled while the push was under way."""
        if not self.holds(c):
            return None
        if reason == "replayed" and c.seq > merged_seq:
            c.acknowledged = True
            return None
        if reason == "replayed":
            return self._settle(c, merged=True)
        return self._settle(c, merged=False, reason=reason, detail=detail)

    def dropped_unsent(self, fragment: int, reason: str, work_s: float = 0.0) -> Settled:
        """A contribution given up before it was ever sent (so it holds no seq)."""
        self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        return Settled(fragment, None, merged=False, reason=reason, work_s=work_s)

    def to_push_again(self) -> list[Contribution]:
        """What the coordinator does not hold and no push is carrying, oldest first."""
        return [c for c in self.held() if not c.acknowledged and not c.in_flight]

    def pushing_again(self, c: Contribution) -> bool:
        """Whether `c` (from `to_push_again`) still is to be pushed again, counted
        if so: pushes of the ones before it may have settled or sent it."""
        if not self.holds(c) or c.acknowledged or c.in_flight:
            return False
        self.stats.repushed += 1
        return True

    def _settle(self, c: Contribution, merged: bool, reason: str = "",
                detail: str = "") -> Settled:
        del self._held[(c.fragment, c.seq)]
        if merged:
            self.stats.merged += 1
        else:
            self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
        return Settled(c.fragment, c.seq, merged, reason, detail)
