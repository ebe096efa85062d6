"""TRL adapter: a GRPOTrainer reward function backed by retrace.

TRL (trl/trainer/grpo_trainer.py, GRPOTrainer._calculate_rewards) calls each custom reward
function as `func(prompts=prompts, completions=completions, completion_ids=completion_ids_list,
**reward_kwargs)`, where reward_kwargs holds the batch's other dataset columns (one list entry
per sample) and `trainer_state`. A function for which asyncio.iscoroutinefunction() is true is
awaited on TRL's own daemon event loop (asyncio.run_coroutine_threadsafe), concurrently with
the other async reward functions; a plain one is called inline. TRL logs rewards under the
function's __name__, and a None reward leaves that sample out of this function's sum.

So a sample with no verdict (unreadable, or refused, timed out or unreachable at the server) gets
None, never a made-up 0.0; only an empty completion gets a stand-in, `empty_reward`, as it does
at /get_reward. TRL adds the reward functions' results with nansum: a sample that every function
leaves out sums to 0.0 there, with TRL's warning "All reward functions returned None".

Prompts and completions are plain strings, or, for conversational datasets, lists of
{"role", "content"} messages (a completion is `[{"role": "assistant", "content": ...}]`).
Each batch goes as one EvaluateStream burst, so a group of G samples is judged together.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from . import _chat
from ._per_loop import PerLoop
from .aio import AsyncClient
from .client import Client
from .errors import RetraceError
from .rewards import check_rule
from .rewards import reward as apply_rule

log = logging.getLogger("retrace_client.trl")


def _prepare(prompts, completions, kwargs, *, evaluator, threshold, reference_key, empty_reward):
    """The requests of a batch, and the rewards already known (unreadable or empty samples)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    references = kwargs.get(reference_key) if reference_key else None
    if reference_key and references is None:
        raise ValueError(f"reference_key={reference_key!r} names no dataset column in this batch")
    out: list[float | None] = [None] * len(prompts)
    items, slots = [], []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        try:
            question = _chat.question_of(prompt)
            text = _chat.response_of(completion)
        except ValueError as e:
            log.warning("retrace reward: sample %d is unreadable (%s); its reward is None", i, e)
            continue
        if not text.strip():
            # As /get_reward does: an empty rollout is a sample worth `empty_reward`, not an error.
            out[i] = empty_reward
            continue
        item = {"question": question, "text": text, "evaluator": evaluator, "threshold": threshold}
        if references is not None and references[i] is not None:
            item["reference_answer"] = str(references[i])
        items.append(item)
        slots.append(i)
    return out, items, slots


def _collect(out, slots, results, rule) -> list[float | None]:
    failed = []
    for i, result in zip(slots, results):
        if isinstance(result, RetraceError):
            failed.append((i, result))
        else:
            out[i] = apply_rule(result, rule)
    if failed:
        i, first = failed[0]
        log.warning(
            "retrace reward: %d of %d samples failed and get None; sample %d: %s",
            len(failed),
            len(out),
            i,
            first,
        )
        for i, e in failed[1:]:
            log.debug("retrace reward: sample %d: %s", i, e)
    return out


def reward_function(
    address: str | Sequence[str] | None = None,
    evaluator: str = "",
    reward: str = "trace_score",
    *,
    token: str | None = None,
    tls: bool = False,
    root_certificates: str | bytes | None = None,
    timeout: float | None = 300.0,
    retries: int = 3,
    max_in_flight: int = 64,
    threshold: float | None = None,
    reference_key: str | None = None,
    empty_reward: float | None = 0.0,
    name: str | None = None,
    asynchronous: bool = True,
) -> Callable[..., Any]:
    """A reward function for `GRPOTrainer(reward_funcs=[...])`.

    reward: "trace_score", "correct" or "prefix" (see retrace_client.rewards).
    reference_key: a dataset column holding each sample's gold answer (reference-based mode).
    empty_reward: the reward of an empty completion (None to leave it out).
    timeout: the deadline for one batch, retries included.
    asynchronous: True returns an `async def` (TRL awaits it on its loop); False a plain
        function, for TRL versions or callers that only call reward functions synchronously.
    A sample that can't be read or judged gets None, logged, instead of failing the batch.
    """
    check_rule(reward)
    client_kwargs = dict(
        addresses=address,
        token=token,
        tls=tls,
        root_certificates=root_certificates,
        timeout=timeout,
        retries=retries,
    )
    options = dict(evaluator=evaluator, threshold=threshold, reference_key=reference_key, empty_reward=empty_reward)

    if asynchronous:
        clients = PerLoop(lambda: AsyncClient(**client_kwargs))

        async def retrace_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
            out, items, slots = _prepare(prompts, completions, kwargs, **options)
            results = await clients.get().evaluate_many(items, max_in_flight=max_in_flight) if items else []
            return _collect(out, slots, results, reward)

        fn = retrace_reward
    else:
        holder: list[Client] = []

        def retrace_reward_sync(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]:
            if not holder:
                holder.append(Client(**client_kwargs))
            out, items, slots = _prepare(prompts, completions, kwargs, **options)
            results = holder[0].evaluate_many(items, max_in_flight=max_in_flight) if items else []
            return _collect(out, slots, results, reward)

        fn = retrace_reward_sync
    fn.__name__ = fn.__qualname__ = name or f"retrace_{reward}"
    return fn
