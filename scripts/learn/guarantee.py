"""The learning loop's terms for a cascade with `target_agreement`: a head is worth serving for
the share of traces it keeps at the cascade's targets (its coverage), calibrated on one set of
rows and measured on another, neither of which either head chose anything on.

The calibration is `retrace calibrate --target-agreement` (the server's own choice of threshold,
the same code), so what the loop measures is what the server would keep. When the cascade's
`calibration` file lies inside the serving head's folder, the loop writes each candidate's
calibration rows there too: the serving head's rows and the new ones, so the set grows round by
round (and its bound tightens) instead of starting again. The rows move in with the head at a
swap, and the server, which scores its calibration rows again at every swap, chooses the
threshold the loop measured. No head trains on a calibration row's question, and none is measured
on one: a held-out question stays held out in every round (distill's split is by its hash).
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from scripts.lib.common import read_rows, write_jsonl


@dataclass
class Guarantee:
    """What the cascade's config asks: the targets, the reading of confidence, its rows."""

    agreement: float
    confidence: float
    reading: str
    rows: Path
    # The rows' path inside the head folder, when they travel with the head; else None.
    in_head: Path | None
    # The cascade's own threshold, which the server calibrates at; None: the head's.
    threshold: float | None = None

    @staticmethod
    def of(table, head, resolve):
        """The cascade table's guarantee, or None when it sets no `target_agreement`."""
        if table.get("target_agreement") is None:
            return None
        rows = resolve(Path(table["calibration"]))
        inside = head.resolve() in rows.resolve().parents
        return Guarantee(agreement=float(table["target_agreement"]),
                         confidence=float(table.get("target_confidence", 0.9)),
                         reading=table.get("confidence", "verdict"), rows=rows,
                         in_head=rows.resolve().relative_to(head.resolve()) if inside else None,
                         threshold=table.get("threshold"))


def question(row):
    """A row's question, under either name a data file may give it (as `eval` reads them)."""
    return row.get("question", row.get("problem"))


def count(path):
    return len(read_rows(path)) if Path(path).is_file() else 0


def to_calibrate(question):
    """Of a comparison question, whether it calibrates (else it measures): a third part of the
    hash, apart from the parts that hold rows out and split them into selection and comparison."""
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[16:24], "big")
    return h % 2 == 0


def halve(compare):
    """The comparison rows as calibration rows and measurement rows; no question on both."""
    return ([r for r in compare if to_calibrate(question(r))],
            [r for r in compare if not to_calibrate(question(r))])


def key(row):
    return json.dumps([question(row), row.get("steps"), row.get("text")])


def sets(g, serving, every, newest, here):
    """The rows each head is calibrated on and measured on, as files in `here`, and the
    calibration rows' questions (no head may train, choose or be compared on them). Where the
    rows travel with the head, they are the serving head's (from its folder, `serving`) and the
    calibration half of every comparison row recorded (`every`), so none is lost when a
    candidate is not swapped in; otherwise the server's own calibration file. The other half of
    the newest comparison rows (`newest`) measures, but for any on a calibration row's question."""
    if g.in_head is None:
        cal, path = read_rows(g.rows), g.rows
        measure = newest
    else:
        old = serving / g.in_head
        cal = read_rows(old) if old.is_file() else []
        seen = {key(r) for r in cal}
        cal = cal + [r for r in halve(every)[0] if key(r) not in seen]
        measure = halve(newest)[1]
        path = here / "calibration.jsonl"
        write_jsonl(path, cal)
    questions = {question(r) for r in cal}
    write_jsonl(here / "measure.jsonl", [r for r in measure if question(r) not in questions])
    return path, here / "measure.jsonl", questions


def coverage(run, retrace, config, cal, measure, g, out):
    """The head of `config` at the cascade's targets: calibrated on `cal`, measured on `measure`.
    Returns the share of measurement rows it keeps, their agreement with the labels (None when
    it keeps none), and the confidence threshold chosen (None when no threshold holds)."""
    run([retrace, "calibrate", "--config", str(config), "--evaluator", "head",
         "--calibrate-on", str(cal), "--test-on", str(measure),
         "--target-agreement", str(g.agreement), "--target-confidence", str(g.confidence),
         "--out", str(out), "--no-progress"], out.parent / "calibrate.log")
    report = json.loads((out / "head" / "guarantee.json").read_text())
    way = next(w for w in report["ways"] if w["confidence"] == g.reading)
    test = way["test"]
    share = test["kept"] / test["rows"] if test["rows"] else 0.0
    agreement = test["agreed"] / test["kept"] if test["kept"] else None
    return {"coverage": share, "agreement": agreement, "threshold": way["threshold"],
            "calibration_rows": way["calibration_rows"], "measured_rows": test["rows"]}


def decide(metric, serving, candidate, cover=None):
    """Whether the candidate replaces the serving head, and why. With the cascade's guarantee,
    the head that keeps more at the targets wins; at equal coverage (both keeping nothing, as
    while neither head clears the target), the metric decides as it does without one: a
    candidate no worse than the serving head."""
    if cover is not None:
        s, c = cover["serving"]["coverage"], cover["candidate"]["coverage"]
        if c > s:
            return True, f"coverage {c:.1%} > {s:.1%}"
        if c < s:
            return False, f"kept: the candidate's coverage {c:.1%} < the serving head's {s:.1%}"
    if candidate < serving:
        return False, f"kept: the candidate's dev {metric} {candidate:.2f} < the serving head's {serving:.2f}"
    return True, f"dev {metric} {candidate:.2f} >= {serving:.2f}"
