"""The reward rules on verdicts built by hand: the same numbers /get_reward gives (no server)."""

from __future__ import annotations

import math

import pytest

from retrace_client.models import StepVerdict, Verdict
from retrace_client.rewards import reward


def verdict(first: int, scores: list[float], trace_score: float, outcome: float | None) -> Verdict:
    steps = [StepVerdict(f"s{i}", s, 0, 0) for i, s in enumerate(scores)]
    return Verdict(id="", evaluator="e", first_error_index=first, category="none", steps=steps,
                   trace_score=trace_score, rationale="", threshold=0.5, path="prm",
                   outcome_score=outcome)


def test_a_composite_verdict_serves_every_rule():
    v = verdict(1, [0.9, 0.2, 0.8, 0.7], 0.2, -1.0)
    assert reward(v, "trace_score") == 0.2
    assert reward(v, "correct") == 0.0
    assert reward(v, "prefix") == 0.25
    assert reward(v, "outcome") == -1.0
    assert reward(v, "min_with_outcome") == pytest.approx(min(0.2, 1 / (1 + math.e)))


def test_an_outcome_only_verdict_is_wrong_without_a_step():
    alone = verdict(-2, [], -1.0, -1.0)
    assert not alone.correct
    assert reward(alone, "correct") == 0.0
    assert reward(alone, "outcome") == -1.0
    with pytest.raises(ValueError, match="needs step scores"):
        reward(alone, "prefix")
    with pytest.raises(ValueError, match="needs an outcome score"):
        reward(verdict(-1, [0.9], 0.9, None), "outcome")
