"""loop_bench's resume: the rounds before --from-round come back from the stopped run's log."""

import json

import pytest

from scripts.learn.loop_bench import earlier_rounds


def write(log, rounds):
    log.write_text("".join(json.dumps({"round": k, "traces": 10}) + "\n" for k in rounds))


def test_a_run_from_the_start_reads_nothing(tmp_path):
    write(tmp_path / "loop.jsonl", [1, 2])
    assert earlier_rounds(tmp_path / "loop.jsonl", 1) == []


def test_a_resume_reads_the_rounds_before_it_and_drops_later_ones(tmp_path):
    write(tmp_path / "loop.jsonl", [1, 2, 3])
    assert [r["round"] for r in earlier_rounds(tmp_path / "loop.jsonl", 3)] == [1, 2]


@pytest.mark.parametrize("held", [[], [1], [2]])
def test_a_resume_with_a_hole_stops(tmp_path, held):
    write(tmp_path / "loop.jsonl", held)
    with pytest.raises(SystemExit, match="--from-round 3"):
        earlier_rounds(tmp_path / "loop.jsonl", 3)


def test_a_resume_without_a_log_stops(tmp_path):
    with pytest.raises(SystemExit, match="holds rounds \\[\\]"):
        earlier_rounds(tmp_path / "loop.jsonl", 2)
