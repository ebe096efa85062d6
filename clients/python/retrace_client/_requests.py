"""Builds request messages from call arguments and from evaluate_many's items.

Only shapes are checked here (a bare string passed as `steps` would become one step per
character); what the server validates (empty steps, sizes, thresholds) is left to the server,
whose messages name the field.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from ._proto import pb

_TRACE_KEYS = ("question", "steps", "text", "options", "reference_answer")
_ITEM_KEYS = frozenset(_TRACE_KEYS) | {"id", "evaluator", "threshold"}


def _strings(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of strings, not a single string")
    out = list(value)
    for i, s in enumerate(out):
        if not isinstance(s, str):
            raise TypeError(f"{name}[{i}] must be a str, not {type(s).__name__}")
    return out


def trace(
    question: str,
    steps: Sequence[str] | None = None,
    text: str | None = None,
    options: Sequence[str] | None = None,
    reference_answer: str | None = None,
) -> "pb.Trace":
    return pb.Trace(
        question=question or "",
        steps=_strings("steps", steps),
        text=text or "",
        options=_strings("options", options),
        reference_answer=reference_answer or "",
    )


def evaluate_request(
    question: str,
    steps: Sequence[str] | None = None,
    text: str | None = None,
    *,
    options: Sequence[str] | None = None,
    reference_answer: str | None = None,
    evaluator: str = "",
    threshold: float | None = None,
    id: str = "",
) -> "pb.EvaluateRequest":
    req = pb.EvaluateRequest(
        id=id or "",
        evaluator=evaluator or "",
        trace=trace(question, steps, text, options, reference_answer),
    )
    if threshold is not None:
        req.threshold = float(threshold)
    return req


def item_request(item: Any) -> "pb.EvaluateRequest":
    """One evaluate_many item as a request: an EvaluateRequest or Trace message, a mapping with
    the Trace keys (plus optional id, evaluator, threshold), or any object with those attributes
    (a models.Trace, a dataclass of the caller's)."""
    if isinstance(item, pb.EvaluateRequest):
        out = pb.EvaluateRequest()
        out.CopyFrom(item)
        return out
    if isinstance(item, pb.Trace):
        return pb.EvaluateRequest(trace=item)
    if isinstance(item, Mapping):
        unknown = set(item) - _ITEM_KEYS
        if unknown:
            raise TypeError(f"unknown item keys {sorted(unknown)}; expected some of {sorted(_ITEM_KEYS)}")
        fields = dict(item)
    elif hasattr(item, "question"):
        fields = {k: getattr(item, k) for k in _ITEM_KEYS if hasattr(item, k)}
    else:
        raise TypeError(f"an item must be a mapping or a Trace-like object, not {type(item).__name__}")
    question = fields.pop("question", "")
    steps = fields.pop("steps", None)
    text = fields.pop("text", None)
    return evaluate_request(question, steps, text, **fields)


def rank_request(
    question: str,
    candidates: Iterable[Any],
    *,
    options: Sequence[str] | None = None,
    reference_answer: str | None = None,
    evaluator: str = "",
    threshold: float | None = None,
    id: str = "",
) -> "pb.RankRequest":
    """A candidate is raw text (a str, segmented by the server), a list of steps, a mapping
    with `steps` and/or `text`, or a Trace-like object (only its steps and text are read)."""
    msgs = []
    for i, c in enumerate(candidates):
        if isinstance(c, str):
            msgs.append(pb.Trace(text=c))
        elif isinstance(c, pb.Trace):
            msgs.append(c)
        elif isinstance(c, Mapping):
            msgs.append(pb.Trace(steps=_strings(f"candidates[{i}].steps", c.get("steps")), text=c.get("text") or ""))
        elif hasattr(c, "steps") or hasattr(c, "text"):
            steps = _strings(f"candidates[{i}].steps", getattr(c, "steps", None))
            msgs.append(pb.Trace(steps=steps, text=getattr(c, "text", "") or ""))
        else:
            msgs.append(pb.Trace(steps=_strings(f"candidates[{i}]", c)))
    req = pb.RankRequest(
        id=id or "",
        evaluator=evaluator or "",
        question=question or "",
        options=_strings("options", options),
        reference_answer=reference_answer or "",
        candidates=msgs,
    )
    if threshold is not None:
        req.threshold = float(threshold)
    return req
