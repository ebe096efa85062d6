"""Reward rules: how a verdict becomes one number for a trainer.

The same rules, under the same names, as the server's POST /get_reward (`?rule=`), so
a reward computed here and one computed by the server for the same trace agree.
"""

from __future__ import annotations

import math

RULES = ("trace_score", "correct", "prefix", "outcome", "min_with_outcome")


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown reward rule {rule!r}; expected one of {', '.join(RULES)}")
    return rule


def reward(verdict, rule: str = "trace_score") -> float:
    """trace_score: the verdict's trace score. correct: 1.0 when the trace holds, else 0.0.
    prefix: the share of steps before the first wrong one (1.0 when none is wrong). outcome: the
    outcome reward model's raw score. min_with_outcome: min(trace score, sigmoid(outcome score)).
    The last two need a verdict with an outcome score (a composite's); prefix and
    min_with_outcome need step scores."""
    check_rule(rule)
    first = verdict.first_error_index
    outcome = getattr(verdict, "outcome_score", None)
    if rule in ("outcome", "min_with_outcome") and outcome is None:
        raise ValueError(f"rule {rule!r} needs an outcome score; evaluator {verdict.evaluator!r} gives none")
    if rule in ("prefix", "min_with_outcome") and not verdict.steps:
        raise ValueError(f"rule {rule!r} needs step scores; evaluator {verdict.evaluator!r} gives none")
    if rule == "trace_score":
        return float(verdict.trace_score)
    if rule == "correct":
        return 1.0 if first == -1 else 0.0
    if rule == "outcome":
        return float(outcome)
    if rule == "min_with_outcome":
        return min(float(verdict.trace_score), 1.0 / (1.0 + math.exp(-outcome)))
    n = len(verdict.steps)
    return 1.0 if first == -1 or n == 0 else first / n
