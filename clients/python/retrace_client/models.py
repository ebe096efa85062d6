"""Typed values: the Trace a caller sends, frozen result dataclasses, and their conversion.

Enums become short lower-case strings: ERROR_CATEGORY_REASONING is "reasoning",
DECISION_PATH_PRM is "prm", so callers compare against plain words and never import the
generated enums.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ._proto import pb


def _enum_word(enum, value: int, prefix: str) -> str:
    try:
        return enum.Name(value)[len(prefix) :].lower()
    except ValueError:
        # A newer server may send a value this client's proto doesn't know yet.
        return f"unknown({value})"


@dataclass(frozen=True)
class Trace:
    """A question and its chain of thought, as `steps` or as raw `text` the server segments."""

    question: str
    steps: Sequence[str] = ()
    text: str = ""
    options: Sequence[str] = ()
    reference_answer: str = ""


@dataclass(frozen=True)
class StepVerdict:
    text: str
    # Probability that the step is correct, in [0, 1].
    score: float
    # Byte offsets into the request's `text` when the server segmented it; else 0.
    start: int
    end: int


@dataclass(frozen=True)
class Timing:
    queue_s: float
    inference_s: float
    total_s: float


@dataclass(frozen=True)
class Verdict:
    id: str
    evaluator: str
    # -1 when the trace holds; -2 when an outcome reward model alone found it wrong (no step named).
    first_error_index: int
    # "none", "misinterpretation", "hallucination", "reasoning" or "unspecified".
    category: str
    steps: list[StepVerdict]
    trace_score: float
    rationale: str
    threshold: float
    # "prm", "judge", "escalated", "categorized" or "unspecified".
    path: str
    timing: Timing = field(default_factory=lambda: Timing(0.0, 0.0, 0.0))
    # An outcome reward model's raw score (a composite, or an outcome-rm PRM); None otherwise.
    outcome_score: float | None = None

    @property
    def correct(self) -> bool:
        return self.first_error_index == -1

    def reward(self, rule: str = "trace_score") -> float:
        """This verdict's reward under `rule` (see `rewards.RULES`)."""
        from .rewards import reward

        return reward(self, rule)

    @classmethod
    def from_pb(cls, m) -> "Verdict":
        t = m.timing
        return cls(
            id=m.id,
            evaluator=m.evaluator,
            first_error_index=m.first_error_index,
            category=_enum_word(pb.ErrorCategory, m.category, "ERROR_CATEGORY_"),
            steps=[StepVerdict(s.text, s.score, s.start, s.end) for s in m.steps],
            trace_score=m.trace_score,
            rationale=m.rationale,
            threshold=m.threshold,
            path=_enum_word(pb.DecisionPath, m.path, "DECISION_PATH_"),
            timing=Timing(t.queue_s, t.inference_s, t.total_s),
            outcome_score=m.outcome_score if m.HasField("outcome_score") else None,
        )


@dataclass(frozen=True)
class RankedCandidate:
    # The candidate's position in the request.
    index: int
    verdict: Verdict


@dataclass(frozen=True)
class Ranking:
    id: str
    evaluator: str
    # Best first (trace score descending; ties keep request order).
    ranked: list[RankedCandidate]

    @property
    def best(self) -> RankedCandidate:
        return self.ranked[0]

    @property
    def order(self) -> list[int]:
        """Candidate indices, best first."""
        return [c.index for c in self.ranked]

    @classmethod
    def from_pb(cls, m) -> "Ranking":
        ranked = [RankedCandidate(c.index, Verdict.from_pb(c.verdict)) for c in m.ranked]
        return cls(id=m.id, evaluator=m.evaluator, ranked=ranked)


@dataclass(frozen=True)
class EvaluatorInfo:
    name: str
    kind: str
    family: str
    model: str
    threshold: float
    max_steps: int
    max_trace_bytes: int
    ready: bool
    is_default: bool
    aggregate: str

    @classmethod
    def from_pb(cls, m) -> "EvaluatorInfo":
        return cls(
            name=m.name,
            kind=m.kind,
            family=m.family,
            model=m.model,
            threshold=m.threshold,
            max_steps=m.max_steps,
            max_trace_bytes=m.max_trace_bytes,
            ready=m.ready,
            is_default=m.is_default,
            aggregate=m.aggregate,
        )
