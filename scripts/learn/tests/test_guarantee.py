"""The loop's terms under a cascade's guarantee: which rows calibrate and which measure, where
the calibration rows travel, and which head wins."""
from pathlib import Path

from scripts.learn import guarantee
from scripts.lib.common import read_rows, write_jsonl


def rows(n):
    return [{"question": f"q{i // 2}", "steps": ["s"], "label": -1} for i in range(n)]


def test_calibration_and_measurement_rows_share_no_question():
    cal, measure = guarantee.halve(rows(2000))
    q = lambda rs: {r["question"] for r in rs}  # noqa: E731
    assert cal and measure and not q(cal) & q(measure)
    assert len(cal) + len(measure) == 2000
    assert 0.4 < len(cal) / 2000 < 0.6


def test_the_calibration_rows_travel_with_the_head_only_when_they_live_in_its_folder(tmp_path):
    head = tmp_path / "heads" / "mine"
    resolve = lambda p: p if p.is_absolute() else tmp_path / p  # noqa: E731
    table = {"target_agreement": 0.9, "calibration": "heads/mine/cal/rows.jsonl"}
    g = guarantee.Guarantee.of(table, head, resolve)
    assert g.in_head == Path("cal/rows.jsonl")
    assert (g.agreement, g.confidence, g.reading) == (0.9, 0.9, "verdict")
    apart = guarantee.Guarantee.of({**table, "calibration": "rows.jsonl", "confidence": "margin"},
                                   head, resolve)
    assert apart.in_head is None and apart.reading == "margin"
    assert guarantee.Guarantee.of({"escalate_margin": 0.1}, head, resolve) is None
    # Apart from the head, the server's own file calibrates, and the comparison rows measure but
    # for those on its questions.
    write_jsonl(tmp_path / "rows.jsonl", rows(4))
    cal, measure, questions = guarantee.sets(apart, head, rows(10), rows(10), tmp_path)
    assert cal == tmp_path / "rows.jsonl" and questions == {"q0", "q1"}
    assert len(measure.read_text().splitlines()) == 6
    # In the head's folder: the serving head's rows grow by the comparison set's calibration
    # half, and the other half measures.
    (head / "cal").mkdir(parents=True)
    old = [{"question": "old", "steps": ["s"], "label": 0}]
    write_jsonl(head / "cal" / "rows.jsonl", old)
    cal, measure, questions = guarantee.sets(g, head, rows(40), rows(40), tmp_path)
    cal_rows, measured = read_rows(cal), read_rows(measure)
    assert cal_rows[0] == old[0] and "old" in questions
    assert len(cal_rows) - 1 + len(measured) == 40
    assert not {r["question"] for r in measured} & questions
    # A second round over the same rows adds none twice.
    write_jsonl(head / "cal" / "rows.jsonl", cal_rows)
    (tmp_path / "again").mkdir()
    again, _, _ = guarantee.sets(g, head, rows(40), rows(40), tmp_path / "again")
    assert read_rows(again) == cal_rows
    # The calibration half comes from every comparison row, measurement from the newest only:
    # rows that left the newest window still calibrate when the head serving never took them.
    (head / "cal" / "rows.jsonl").unlink()
    (tmp_path / "window").mkdir()
    cal, measure, _ = guarantee.sets(g, head, rows(400), rows(400)[-40:], tmp_path / "window")
    assert len(read_rows(cal)) > 100 and len(read_rows(measure)) < 40
    # ProcessBench's own files name the question `problem`.
    assert guarantee.halve([{"problem": "p", "steps": []}]) in (([{"problem": "p", "steps": []}], []),
                                                                 ([], [{"problem": "p", "steps": []}]))


def cover(serving, candidate):
    return {"serving": {"coverage": serving}, "candidate": {"coverage": candidate}}


def test_coverage_at_the_targets_decides_before_the_metric():
    # Keeps more at the targets: swapped, though its F1 is lower.
    better, why = guarantee.decide("f1", 60.0, 40.0, cover(0.1, 0.3))
    assert better and "coverage" in why
    # Keeps less: kept, though its F1 is higher.
    better, why = guarantee.decide("f1", 40.0, 60.0, cover(0.3, 0.1))
    assert not better and "coverage" in why
    # Keeps as much (nothing): the metric decides, as without a guarantee.
    assert guarantee.decide("f1", 40.0, 60.0, cover(0.0, 0.0))[0]
    assert not guarantee.decide("f1", 60.0, 40.0, cover(0.0, 0.0))[0]
    assert guarantee.decide("f1", 40.0, 40.0, None)[0]
