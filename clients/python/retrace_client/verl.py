"""verl adapter: `custom_reward_function`s backed by retrace.

verl loads `custom_reward_function.path` (this file's path, or `pkg://retrace_client.verl` where
verl's load_extern_object takes module paths) and takes `.name` from it (get_custom_reward_fn
in verl/trainer/ppo/reward.py), binding `custom_reward_function.reward_kwargs` as extra keyword
arguments. Its reward managers then call, per sample (workers/reward_manager/naive.py and the
reward loop's managers), `compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=...)`; a coroutine function is awaited, a plain one run in an executor. The batch
manager (workers/reward_manager/batch.py) calls `compute_score(data_sources=...,
solution_strs=..., ground_truths=..., extra_infos=...)` once per batch: that is
compute_score_batch here. A returned dict's "score" is the reward and each key is logged.

So every option below is a reward_kwargs key. The question comes from `extra_info`, where
verl's preprocess scripts put it (examples/data_preprocess/gsm8k.py: extra_info["question"]);
`question_key` names another key. `use_ground_truth=True` sends ground_truth as the reference
answer (reference-based judging).

A sample with no verdict (the server refused it, timed out or was unreachable): verl writes
"score" straight into the reward tensor at the response's last token and has no value meaning
"leave this sample out" (a NaN would spread through its group's advantages into the loss), so
the failure is raised, as verl expects of a reward function that cannot score. `error_score`
opts into a stand-in instead, and only with return_dict=True: the dict then says
retrace_failed=1.0, and its verdict keys (first_error_index, step_count, trace_score) are NaN,
so neither the reward nor the logged metrics pass it off as a verdict. An empty response is not
a failure: it scores 0.0, as /get_reward's default empty_reward does.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Mapping, Sequence

# Absolute imports: older verl loads `custom_reward_function.path` as a file under the name
# "custom_module" (importlib spec_from_file_location), where relative imports have no package.
from retrace_client import _chat
from retrace_client._per_loop import PerLoop
from retrace_client.aio import AsyncClient
from retrace_client.client import Client
from retrace_client.errors import RetraceError
from retrace_client.rewards import check_rule
from retrace_client.rewards import reward as apply_rule

log = logging.getLogger("retrace_client.verl")

QUESTION_KEYS = ("question", "problem", "query", "prompt")

_sync_clients: dict[tuple, Client] = {}
_async_clients: dict[tuple, PerLoop] = {}
_lock = threading.Lock()


def _client_key(address, token, tls, root_certificates, timeout, retries) -> tuple:
    address = tuple(address) if isinstance(address, (list, tuple)) else address
    return (address, token, tls, root_certificates, timeout, retries)


def _kwargs(key: tuple) -> dict:
    address, token, tls, root_certificates, timeout, retries = key
    return dict(
        addresses=list(address) if isinstance(address, tuple) else address,
        token=token,
        tls=tls,
        root_certificates=root_certificates,
        timeout=timeout,
        retries=retries,
    )


def _sync_client(key: tuple) -> Client:
    # One client per settings per process: a reward worker scores thousands of samples.
    with _lock:
        if key not in _sync_clients:
            _sync_clients[key] = Client(**_kwargs(key))
        return _sync_clients[key]


def _async_client(key: tuple) -> AsyncClient:
    with _lock:
        if key not in _async_clients:
            _async_clients[key] = PerLoop(lambda: AsyncClient(**_kwargs(key)))
        per_loop = _async_clients[key]
    return per_loop.get()


def question_from(extra_info: Mapping[str, Any] | None, question_key: str | None = None) -> str:
    """The sample's question from verl's extra_info; a clear error when it holds none."""
    info = extra_info or {}
    keys = (question_key,) if question_key else QUESTION_KEYS
    for k in keys:
        value = info.get(k)
        if value is None:
            continue
        if not isinstance(value, str):
            # A chat prompt stored as messages (a list, or a numpy array of dicts in a parquet row).
            value = list(value)
        q = _chat.question_of(value)
        if q:
            return q
    raise ValueError(
        f"retrace verl adapter: extra_info holds no question under {', '.join(map(repr, keys))} "
        f"(its keys: {sorted(info)}); put the question in extra_info['question'] in the preprocess "
        "script, or name its key with custom_reward_function.reward_kwargs.question_key=KEY"
    )


def _item(solution_str, ground_truth, extra_info, *, question_key, use_ground_truth, evaluator, threshold):
    item = {
        "question": question_from(extra_info, question_key),
        "text": _chat.strip_end_markers(solution_str or ""),
        "evaluator": evaluator,
        "threshold": threshold,
    }
    if use_ground_truth and ground_truth is not None:
        item["reference_answer"] = str(ground_truth)
    return item


# A failed sample's verdict keys: it has no verdict, so none is made up (-1 would read "holds").
_NO_VERDICT = {"first_error_index": math.nan, "step_count": math.nan, "trace_score": math.nan}


def _score(result, rule: str, return_dict: bool, error_score: float | None):
    if isinstance(result, RetraceError):
        if error_score is None:
            raise result
        log.warning("retrace verl adapter: a sample failed and scores error_score=%s: %s", error_score, result)
        score, extras, failed = float(error_score), dict(_NO_VERDICT), 1.0
    elif result is None:  # an empty response: scored like /get_reward's empty_reward
        score, extras, failed = 0.0, {"first_error_index": -1, "step_count": 0, "trace_score": 0.0}, 0.0
    else:
        score = apply_rule(result, rule)
        extras = {
            "first_error_index": result.first_error_index,
            "step_count": len(result.steps),
            "trace_score": float(result.trace_score),
        }
        failed = 0.0
    if not return_dict:
        return score
    # verl appends every key of every sample's dict into one column, so the keys never vary.
    return {"score": score, **extras, "retrace_failed": failed}


# Keywords verl itself adds to the call (the reward loop, when a reward model router runs).
_VERL_EXTRAS = frozenset({"reward_router_address", "reward_model_tokenizer"})
_warned: set[str] = set()


def _warn_unknown(extra: Mapping[str, Any]) -> None:
    # A misspelt reward_kwargs key (`adress=`) would otherwise fall back to a default silently.
    for k in sorted(set(extra) - _VERL_EXTRAS - _warned):
        _warned.add(k)
        log.warning("retrace verl adapter: ignoring unknown keyword argument %r", k)


def _check_error_score(error_score: float | None, return_dict: bool) -> None:
    # A bare float stand-in would be indistinguishable from a verdict's reward, in training and in logs.
    if error_score is not None and not return_dict:
        raise ValueError(
            "retrace verl adapter: error_score needs return_dict=True, so that a stand-in score is "
            "flagged (retrace_failed=1.0) rather than passed off as a verdict's reward"
        )


def _options(reward, evaluator, threshold, use_ground_truth, question_key):
    check_rule(reward)
    return dict(evaluator=evaluator, threshold=threshold, use_ground_truth=use_ground_truth, question_key=question_key)


def compute_score(
    data_source: Any = None,
    solution_str: str = "",
    ground_truth: Any = None,
    extra_info: Mapping[str, Any] | None = None,
    *,
    address: str | Sequence[str] | None = None,
    evaluator: str = "",
    reward: str = "trace_score",
    use_ground_truth: bool = False,
    question_key: str | None = None,
    threshold: float | None = None,
    return_dict: bool = False,
    error_score: float | None = None,
    token: str | None = None,
    tls: bool = False,
    root_certificates: str | None = None,
    timeout: float | None = 60.0,
    retries: int = 3,
    **_ignored: Any,
) -> float | dict:
    """One sample's reward (a float, or with return_dict=True a dict with "score" and extras).

    A failed call raises its RetraceError unless `error_score` is set (with return_dict=True):
    the dict then carries that score, retrace_failed=1.0 and NaN verdict keys. Keywords verl
    adds (reward_router_address, reward_model_tokenizer) are ignored; any other unknown one is
    ignored with a warning."""
    _warn_unknown(_ignored)
    _check_error_score(error_score, return_dict)
    opts = _options(reward, evaluator, threshold, use_ground_truth, question_key)
    item = _item(solution_str, ground_truth, extra_info, **opts)
    if not item["text"].strip():
        return _score(None, reward, return_dict, error_score)
    client = _sync_client(_client_key(address, token, tls, root_certificates, timeout, retries))
    try:
        result = client.evaluate(**item)
    except RetraceError as e:
        result = e
    return _score(result, reward, return_dict, error_score)


async def compute_score_async(
    data_source: Any = None,
    solution_str: str = "",
    ground_truth: Any = None,
    extra_info: Mapping[str, Any] | None = None,
    *,
    address: str | Sequence[str] | None = None,
    evaluator: str = "",
    reward: str = "trace_score",
    use_ground_truth: bool = False,
    question_key: str | None = None,
    threshold: float | None = None,
    return_dict: bool = False,
    error_score: float | None = None,
    token: str | None = None,
    tls: bool = False,
    root_certificates: str | None = None,
    timeout: float | None = 60.0,
    retries: int = 3,
    **_ignored: Any,
) -> float | dict:
    """compute_score as a coroutine, for verl's reward loop (awaited on its event loop)."""
    _warn_unknown(_ignored)
    _check_error_score(error_score, return_dict)
    opts = _options(reward, evaluator, threshold, use_ground_truth, question_key)
    item = _item(solution_str, ground_truth, extra_info, **opts)
    if not item["text"].strip():
        return _score(None, reward, return_dict, error_score)
    client = _async_client(_client_key(address, token, tls, root_certificates, timeout, retries))
    try:
        result = await client.evaluate(**item)
    except RetraceError as e:
        result = e
    return _score(result, reward, return_dict, error_score)


def compute_score_batch(
    data_sources: Sequence[Any] = (),
    solution_strs: Sequence[str] = (),
    ground_truths: Sequence[Any] = (),
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    *,
    address: str | Sequence[str] | None = None,
    evaluator: str = "",
    reward: str = "trace_score",
    use_ground_truth: bool = False,
    question_key: str | None = None,
    threshold: float | None = None,
    return_dict: bool = False,
    error_score: float | None = None,
    token: str | None = None,
    tls: bool = False,
    root_certificates: str | None = None,
    timeout: float | None = 300.0,
    retries: int = 3,
    max_in_flight: int = 64,
    **_ignored: Any,
) -> list[float | dict]:
    """For verl's batch reward manager: the whole batch over one stream, scores in order."""
    _warn_unknown(_ignored)
    _check_error_score(error_score, return_dict)
    opts = _options(reward, evaluator, threshold, use_ground_truth, question_key)
    n = len(solution_strs)
    extra_infos = [None] * n if extra_infos is None else list(extra_infos)
    ground_truths = list(ground_truths) if len(ground_truths) else [None] * n
    items = [_item(solution_strs[i], ground_truths[i], extra_infos[i], **opts) for i in range(n)]
    live = [i for i, it in enumerate(items) if it["text"].strip()]
    client = _sync_client(_client_key(address, token, tls, root_certificates, timeout, retries))
    results: list[Any] = [None] * n
    for i, r in zip(live, client.evaluate_many([items[i] for i in live], max_in_flight=max_in_flight)):
        results[i] = r
    return [_score(r, reward, return_dict, error_score) for r in results]

