"""Reward rules: how a verdict becomes one number for a trainer.

The same three rules, under the same names, as the server's POST /get_reward (`?reward=`), so
a reward computed here and one computed by the server for the same trace agree.
"""

from __future__ import annotations

RULES = ("trace_score", "correct", "prefix")


def check_rule(rule: str) -> str:
    if rule not in RULES:
        raise ValueError(f"unknown reward rule {rule!r}; expected one of {', '.join(RULES)}")
    return rule


def reward(verdict, rule: str = "trace_score") -> float:
    """trace_score: the verdict's trace score. correct: 1.0 when no step is wrong, else 0.0.
    prefix: the share of steps before the first wrong one (1.0 when none is wrong)."""
    check_rule(rule)
    first = verdict.first_error_index
    if rule == "trace_score":
        return float(verdict.trace_score)
    if rule == "correct":
        return 1.0 if first < 0 else 0.0
    n = len(verdict.steps)
    return 1.0 if first < 0 or n == 0 else first / n
