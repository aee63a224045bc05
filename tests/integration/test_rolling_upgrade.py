"""Drains as an upgrade does them, through the user's command (`ftsync-chaos run`).

`experiments/rolling-upgrade.toml` itself, on a synthetic workload and a
shorter clock: the standby, then the leader, is drained and restarted; the
leader's drain hands the run to the upgraded standby, and every check passes
(exactly-once over the replicas' published history among them). A single
coordinator drained the same way exits 0 and resumes where it stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_chaos_faults import AFTER_THE_FIRST_MERGE, AT, EXPERIMENT, run

# Whole experiments or clusters: `deploy/dev test -m 'not slow'` leaves them out.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def edited(text: str, *changes: tuple[str, str]) -> str:
    """`text` with each line-start change made once; each must still be there."""
    for old, new in changes:
        assert f"\n{old}" in text, f"{old!r} is no longer in the experiment"
        text = text.replace(f"\n{old}", f"\n{new}", 1)
    return text


def drains(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == "fault" and e["fault"] == "drain_replica"]


def test_the_rolling_upgrade_experiment_passes_every_check(tmp_path: Path) -> None:
    text = edited((ROOT / "experiments" / "rolling-upgrade.toml").read_text(),
                  ("max_duration_s = 150", "max_duration_s = 60"),
                  ("count = 4", "count = 2"),
                  # At least 20 s of steps, however fast the machine: past the last heal.
                  ('task = "lm-stdlib"', 'task = "synthetic"\nargs = ["--step-ms", "10"]'),
                  ("steps = 1200", "steps = 2000"),
                  # From the first merge of every fragment, however long the learners
                  # take to start.
                  ("at_s = 15", "at_s = 0.5\nafter_version = 1"),
                  ("duration_s = 5", "duration_s = 2"),
                  ("at_s = 40", "at_s = 7.5\nafter_version = 1"),
                  ("duration_s = 5", "duration_s = 2"))
    events, summary = run(tmp_path, "rolling-upgrade", text)
    assert all(check["passed"] for check in summary["checks"]), summary["checks"]
    checks = {check["name"] for check in summary["checks"]}
    assert {"exactly_once_replicas", "no_split_brain", "acknowledged_settled"} <= checks
    faults = drains(events)
    assert [f["action"] for f in faults] == ["inject", "heal", "inject", "heal"], faults
    standby, leader = faults[0], faults[2]
    assert {standby["target"], leader["target"]} == {"r0", "r1"}
    assert standby["detail"].startswith("standby: 0 versions committed")
    assert leader["detail"].startswith("leader: ") and " leads (epoch " in leader["detail"]
    assert all(f["detail"].endswith("exited 0") for f in (standby, leader))
    exits = [e for e in events if e["kind"] == "process_exit" and e["name"] in ("r0", "r1")]
    assert [e["code"] for e in exits] == [0, 0]
    # The upgraded standby took over, and the model advanced after both upgrades.
    handed = [e for e in events if e["kind"] == "elected" and e["t"] > leader["t"] - 30
              and e["replica"] == standby["target"]]
    assert handed, "the upgraded standby was never elected"
    assert any(e["kind"] == "commit" and e["t"] > faults[3]["t"] for e in events)


def test_a_single_coordinator_drained_for_an_upgrade_resumes_where_it_stopped(
        tmp_path: Path) -> None:
    # Once the learners have made the run and its first versions, and 900 steps of at
    # least 20 ms: they are still training when it comes back.
    text = EXPERIMENT.format(kind="drain_replica", target="coordinator", duration=2, top="",
                             coordinator="", steps=900, learners="", etcd="", checks="",
                             extra="").replace(AT, AFTER_THE_FIRST_MERGE).replace(
        '"--step-ms", "5"', '"--step-ms", "20"')
    events, summary = run(tmp_path, "drain-coordinator", text)
    assert all(check["passed"] for check in summary["checks"]), summary["checks"]
    inject, heal = drains(events)
    assert inject["detail"].startswith("leader: ") and inject["detail"].endswith("exited 0")
    starts = [e for e in events if e["kind"] == "process_start" and e["name"] == "coordinator"]
    assert len(starts) == 2
    # Resumed (before the harness logged its restart) and committing again.
    assert any(e["kind"] == "resume" and e["t"] > inject["t"] for e in events)
    assert any(e["kind"] == "commit" and e["t"] > heal["t"] for e in events)
