"""A stuck push against a real daemon: a learner that sends a push header and one
chunk and then holds its stream open is cut after `limits.push_idle_s`, counted as
cut (not as a refusal), nothing of it folded, and its staging goes to another
learner's waiting push, which completes; the cut learner's push goes through when
it sends it again.

Each test starts its own coordinator on an ephemeral port with a 1 s idle limit,
and waits on the daemon's event log for the protocol points it needs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from protos import ftsync_pb2 as pb
from tests.daemon import wait_until
from tests.integration.test_bad_input import (
    GRADIENT,
    NUMEL,
    RPC_TIMEOUT,
    StartDaemon,
    fp32_chunk,
    header,
    join,
    push,
    rejections,
    started,
    stub,
    version,
)

IDLE_S = 1.0
# How long the stuck learners hold their streams open unless the daemon cuts them.
STUCK_S = 60.0


def events(log: Path, kind: str) -> list[dict[str, Any]]:
    return [event for event in map(json.loads, log.read_text().splitlines())
            if event["kind"] == kind]


def stuck(learner_id: str, released: threading.Event) -> Iterator[pb.PushMessage]:
    """A push that sends its header and the first half of its values, then nothing."""
    yield pb.PushMessage(header=header(learner_id=learner_id, seq=2))
    yield pb.PushMessage(chunk=fp32_chunk(GRADIENT, 0, NUMEL // 2))
    released.wait(STUCK_S)


@pytest.mark.parametrize("stuck_learners, staging", [
    (("a",), ("--set", f"limits.staging_bytes={4 * NUMEL}")),  # room for one push
    (("a", "c"), ()),  # the default: room for two pushes of the largest fragment
], ids=["one stuck learner, staging for one push", "two stuck learners, default staging"])
def test_a_stuck_push_is_cut_and_another_learners_push_completes(
        start_daemon: StartDaemon, tmp_path: Path, stuck_learners: tuple[str, ...],
        staging: tuple[str, ...]) -> None:
    log = tmp_path / "events.jsonl"
    daemon = started(start_daemon, "--event-log", str(log),
                     "--set", f"limits.push_idle_s={IDLE_S}", *staging)
    for learner_id in ("b", *stuck_learners[1:]):
        join(daemon, learner_id)
    counts = rejections(daemon)
    released = threading.Event()
    channel, synchronizer = stub(daemon)
    try:
        calls = [synchronizer.PushFragment.future(stuck(learner_id, released),
                                                  timeout=STUCK_S)
                 for learner_id in stuck_learners]
        # The stuck pushes hold every byte of staging before b pushes.
        wait_until(lambda: sorted(e["learner"] for e in events(log, "push_staged")
                                  if e["seq"] == 2) == sorted(stuck_learners),
                   timeout=RPC_TIMEOUT, message="the stuck pushes in staging")
        began = time.monotonic()
        response = push(daemon, learner_id="b", seq=1, base_version=0)
        took = time.monotonic() - began
        errors: list[Any] = [call.exception(RPC_TIMEOUT) for call in calls]
    finally:
        released.set()
        channel.close()
    assert response.target_version == 1
    # b waited for a cut, not for the stuck pushes to end: with no idle limit it waited
    # their 60 s. (The order below says it was a cut that let it in.)
    assert took < STUCK_S / 2, f"b's push took {took:.1f} s"
    order = [(e["kind"], e.get("learner")) for e in map(json.loads, log.read_text().splitlines())]
    # Staging was full: b got in only once a stuck push was cut.
    assert order.index(("push_staged", "b")) > min(
        order.index(("push_cut", learner_id)) for learner_id in stuck_learners), order
    for error in errors:  # the code the learner's client retries on: it pushes again
        assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        details = error.details() or ""
        assert details.startswith("idle:") and "limits.push_idle_s" in details, details
        assert f"after {NUMEL // 2} of {NUMEL} elements" in details, details
    cuts = events(log, "push_cut")
    assert sorted(e["learner"] for e in cuts) == sorted(stuck_learners)
    assert all(e["reason"] == "idle" and e["seq"] == 2 and e["fragment"] == 0 for e in cuts)
    assert rejections(daemon) == counts  # cut, not refused
    status = daemon.status()
    assert status.fragments[0].merged_contributions == 1  # b's alone
    assert {lr.learner_id: lr.contributions for lr in status.learners} == {
        "a": 0, "b": 1, **{learner_id: 0 for learner_id in stuck_learners}}
    # Sent again in full, a's cut push goes through under the same id.
    wait_until(lambda: version(daemon) == 1, timeout=RPC_TIMEOUT, message="b's commit")
    assert push(daemon, learner_id="a", seq=2, base_version=0).target_version == 2
