"""Warm spares without processes: the hand-over line read and refused, the
supervisor's flags refused before anything starts, and `learners.spares` in
experiment files checked with its key."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from learner.cli import _parse_refusing, main
from learner.spare import HandoverRefused, handover_line, parse_handover, wait_for_slot
from tests.unit.test_experiment import BASE, error_of

BUILD = ["--task", "digits", "--size", "tiny", "--threads", "1"]
SLOT = [*BUILD, "--learner-id", "learner-2", "--shard", "2", "--num-shards", "3"]


def spare() -> argparse.Namespace:
    return _parse_refusing([*BUILD, "--spare"])


def test_a_handover_line_round_trips_to_the_slots_settings() -> None:
    slot = parse_handover(handover_line(SLOT), spare(), _parse_refusing)
    assert (slot.learner_id, slot.shard, slot.num_shards, slot.spare) == ("learner-2", 2, 3,
                                                                          False)


@pytest.mark.parametrize("line, needle", [
    ("{not json", "not JSON"),
    ('["--shard", "1"]', 'one JSON object {"args"'),
    ('{"args": ["--shard", "1"], "extra": 1}', 'one JSON object {"args"'),
    ('{"args": "--shard 1"}', "list of strings"),
    (handover_line([*SLOT, "--spare"]), "must not include --spare"),
    (handover_line([*SLOT, "--shard", "7"]), "--shard"),
    (handover_line([*SLOT, "--no-such-flag"]), "unrecognized arguments"),
    (handover_line([*SLOT, "--size", "small"]), "--size 'small' differs from the spare's"),
    (handover_line([*SLOT, "--seed", "3"]), "--seed 3 differs"),
])
def test_a_bad_handover_line_is_refused_by_name(line: str, needle: str) -> None:
    with pytest.raises(HandoverRefused) as info:
        parse_handover(line, spare(), _parse_refusing)
    assert needle in str(info.value)


def test_a_spare_answers_each_bad_line_and_takes_the_next_good_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    lines = io.StringIO("garbage\n\n" + handover_line(SLOT))
    slot = wait_for_slot(spare(), _parse_refusing, 0.5, lines)
    assert slot is not None and slot.learner_id == "learner-2"
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ftsync-spare: ready (digits/tiny")
    assert out[1].startswith("ftsync-spare: refused: not JSON")
    assert out[2] == "ftsync-spare: taking the slot of learner-2 (shard 2)"


def test_a_spare_without_a_slot_ends_at_end_of_input() -> None:
    assert wait_for_slot(spare(), _parse_refusing, 0.1, io.StringIO("")) is None


@pytest.mark.parametrize("argv, needle", [
    (["supervise", "--spares", "0", "--", *SLOT], "--spares and --max-takeovers"),
    (["supervise", "--spares", "1"], "give the learner's flags after --"),
    (["supervise", "--", *SLOT, "--spare"], "must not include --spare"),
    (["supervise", "--", *SLOT, "--shard", "9"], "the learner's flags: --steps and --fragments"),
])
def test_supervise_refuses_bad_flags_before_starting_anything(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("spares, needle", [
    ("-1", "learners.spares must be in 0..count (3) (got -1)"),
    ("4", "learners.spares must be in 0..count (3) (got 4)"),
])
def test_spares_in_an_experiment_are_checked(tmp_path: Path, spares: str, needle: str) -> None:
    assert needle in error_of(tmp_path, BASE + f"spares = {spares}\n")


def test_spares_need_the_process_backend(tmp_path: Path) -> None:
    text = BASE.replace("[learners]", 'backend = "docker"\n\n[learners]') + "spares = 1\n"
    assert 'learners.spares runs on backend = "process" only' in error_of(tmp_path, text)
