"""What names a contribution everywhere: the learner id, the fragment and the
learner-wide seq that exactly-once is about. The coordinator's policy keys its
rounds and manifests by it, the harness's checkers read it back from the event
log, the simulator drives the policy with it. The base version a contribution was
measured from travels beside it (`coordinator.policy.Offer`): two pushes of one
seq are one contribution whatever their bases say. Imports nothing."""

from __future__ import annotations

from typing import NamedTuple


class ContributionId(NamedTuple):
    learner_id: str
    fragment: int
    seq: int

    def __str__(self) -> str:
        return f"{self.learner_id}/{self.fragment}/{self.seq}"
