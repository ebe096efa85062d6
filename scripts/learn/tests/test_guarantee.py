"""The loop's terms under a cascade's guarantee: which rows calibrate and which measure, where
the calibration rows travel, and which head wins."""
from pathlib import Path

from scripts.learn import guarantee


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
    # Apart from the head, the server's own file calibrates and every comparison row measures.
    cal, measure = guarantee.sets(apart, rows(10), tmp_path)
    assert cal == tmp_path / "rows.jsonl"
    assert len(measure.read_text().splitlines()) == 10
    cal, measure = guarantee.sets(g, rows(10), tmp_path)
    assert len(cal.read_text().splitlines()) + len(measure.read_text().splitlines()) == 10


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
