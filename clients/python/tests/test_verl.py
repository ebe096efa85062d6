"""retrace_client.verl called exactly as verl calls a custom_reward_function.

verl/trainer/ppo/reward.py, get_custom_reward_fn: loads custom_reward_function.path, takes
.name, and binds custom_reward_function.reward_kwargs:
    if not inspect.iscoroutinefunction(raw_fn): return partial(_call_with_kwargs, raw_fn, reward_kwargs)
    else: return partial(_call_with_kwargs_async, raw_fn, reward_kwargs)
    def _call_with_kwargs(raw_fn, extra_kwargs, *args, **kwargs): return raw_fn(*args, **{**kwargs, **extra_kwargs})
verl/workers/reward_manager/naive.py, NaiveRewardManager.__call__:
    extra_info = data_item.non_tensor_batch.get("extra_info", {}); extra_info["num_turns"] = num_turns
    score = self.compute_score(data_source=data_source, solution_str=response_str,
                               ground_truth=ground_truth, extra_info=extra_info)
    if isinstance(score, dict): reward = score["score"];
        for key, value in score.items(): reward_extra_info[key].append(value)
The reward loop's managers (experimental/reward_loop/reward_manager/*.py) await a coroutine
function with the same keywords, plus reward_router_address and reward_model_tokenizer when a
reward model router runs. verl/workers/reward_manager/batch.py, BatchRewardManager.verify:
    scores = self.compute_score(data_sources=data_sources, solution_strs=responses_str,
                                ground_truths=ground_truths, extra_infos=extras, **self.reward_kwargs)
with data_sources and extras numpy arrays (non_tensor_batch). extra_info as written by
examples/data_preprocess/gsm8k.py: {"split", "index", "answer", "question"}; math_dataset.py
writes only {"split", "index"}.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
from functools import partial

import numpy as np
import pytest

from fake_judge import expected
from helpers import JUDGE_CASES, SAME_SCORE
from retrace_client import Client, InvalidArgument, Unavailable
from retrace_client import verl as adapter
from retrace_client.testing import free_port

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")
SOLUTION = "In May she sold 48 / 2 = 24 clips.\n\nAltogether she sold 48 + 24 = 72 clips.\n\n#### 72"


def _call_with_kwargs(raw_fn, extra_kwargs, *args, **kwargs):
    return raw_fn(*args, **{**kwargs, **extra_kwargs})


async def _call_with_kwargs_async(raw_fn, extra_kwargs, *args, **kwargs):
    return await raw_fn(*args, **{**kwargs, **extra_kwargs})


def load_like_verl(name: str, reward_kwargs: dict, via: str = "file"):
    """get_custom_reward_fn: the module loaded from its file path (spec_from_file_location, as
    older verl does), or imported by name (load_module's pkg://retrace_client.verl), then the
    function taken by name."""
    if via == "file":
        spec = importlib.util.spec_from_file_location("custom_module", adapter.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module("retrace_client.verl")
    raw_fn = getattr(module, name)
    if not inspect.iscoroutinefunction(raw_fn):
        return partial(_call_with_kwargs, raw_fn, reward_kwargs)
    return partial(_call_with_kwargs_async, raw_fn, reward_kwargs)


def gsm8k_extra_info(index: int, question: str = QUESTION) -> dict:
    info = {"split": "train", "index": index, "answer": SOLUTION, "question": question}
    info["num_turns"] = None  # added by NaiveRewardManager
    return info


@pytest.mark.parametrize("via", ["file", "pkg"])
def test_compute_score_like_the_naive_manager(server, via):
    fn = load_like_verl("compute_score", {"address": server.address}, via)
    score = fn(data_source="openai/gsm8k", solution_str=SOLUTION, ground_truth="72", extra_info=gsm8k_extra_info(0))
    with Client(server.address) as c:
        want = c.evaluate(QUESTION, text=SOLUTION).trace_score
    assert isinstance(score, float) and score == pytest.approx(want, abs=SAME_SCORE)


def test_compute_score_async_like_the_reward_loop(server):
    fn = load_like_verl("compute_score_async", {"address": server.address, "return_dict": True})

    async def reward_loop():
        return await asyncio.gather(
            *(
                fn(data_source="openai/gsm8k", solution_str=SOLUTION, ground_truth="72", extra_info=gsm8k_extra_info(i),
                   reward_router_address=None, reward_model_tokenizer=None)
                for i in range(4)
            )
        )

    results = asyncio.run(reward_loop())
    sync = load_like_verl("compute_score", {"address": server.address, "return_dict": True})
    want = sync(data_source="openai/gsm8k", solution_str=SOLUTION, ground_truth="72", extra_info=gsm8k_extra_info(0))
    assert set(want) == {"score", "first_error_index", "step_count", "trace_score", "retrace_failed"}
    assert want["step_count"] == 3 and want["retrace_failed"] == 0.0
    for r in results:
        assert r.keys() == want.keys()
        assert r["score"] == pytest.approx(want["score"], abs=SAME_SCORE)
        assert r["first_error_index"] == want["first_error_index"]


@pytest.mark.parametrize("rule", ["correct", "prefix"])
def test_rules_with_the_judge(server, rule):
    fn = load_like_verl("compute_score", {"address": server.address, "evaluator": "judge", "reward": rule})
    for steps in JUDGE_CASES:
        index, _ = expected(steps)
        got = fn(data_source="d", solution_str="\n\n".join(steps), ground_truth="x", extra_info={"question": "Q?"})
        if rule == "correct":
            assert got == (1.0 if index == -1 else 0.0)
        else:
            assert got == pytest.approx(1.0 if index == -1 else index / len(steps))


def test_use_ground_truth_sends_the_reference(server, fake_judge):
    fn = load_like_verl("compute_score", {"address": server.address, "evaluator": "judge", "use_ground_truth": True})
    fn(data_source="d", solution_str=SOLUTION, ground_truth="GT-72-UNIQUE", extra_info=gsm8k_extra_info(0))
    assert "GT-72-UNIQUE" in fake_judge.prompts()[-1]
    plain = load_like_verl("compute_score", {"address": server.address, "evaluator": "judge"})
    plain(data_source="d", solution_str=SOLUTION, ground_truth="GT-73-UNIQUE", extra_info=gsm8k_extra_info(0))
    assert "GT-73-UNIQUE" not in fake_judge.prompts()[-1]


def test_batch_manager_shape(server):
    fn = load_like_verl("compute_score_batch", {"address": server.address})
    solutions = [SOLUTION, "", SOLUTION.replace("72", "70")]
    scores = fn(
        data_sources=np.array(["openai/gsm8k"] * 3, dtype=object),
        solution_strs=solutions,
        ground_truths=["72"] * 3,
        extra_infos=np.array([gsm8k_extra_info(i) for i in range(3)], dtype=object),
    )
    with Client(server.address) as c:
        assert scores[0] == pytest.approx(c.evaluate(QUESTION, text=solutions[0]).trace_score, abs=SAME_SCORE)
        assert scores[2] == pytest.approx(c.evaluate(QUESTION, text=solutions[2]).trace_score, abs=SAME_SCORE)
    assert scores[1] == 0.0  # an empty response, as /get_reward's empty_reward


def test_question_sources_and_a_clear_error(server):
    fn = load_like_verl("compute_score", {"address": server.address})
    math_info = {"split": "train", "index": 3}  # what math_dataset.py writes
    with pytest.raises(ValueError, match=r"extra_info holds no question.*question_key"):
        fn(data_source="lighteval/MATH", solution_str=SOLUTION, ground_truth="72", extra_info=math_info)
    with pytest.raises(ValueError, match="no question"):
        fn(data_source="d", solution_str=SOLUTION, ground_truth="72", extra_info=None)
    with_key = load_like_verl("compute_score", {"address": server.address, "question_key": "problem_text"})
    a = with_key(data_source="d", solution_str=SOLUTION, ground_truth="72", extra_info={"problem_text": QUESTION})
    chat = fn(data_source="d", solution_str=SOLUTION, ground_truth="72",
              extra_info={"prompt": np.array([{"role": "user", "content": QUESTION}], dtype=object)})
    b = fn(data_source="d", solution_str=SOLUTION, ground_truth="72", extra_info=gsm8k_extra_info(0))
    assert a == pytest.approx(b, abs=SAME_SCORE) and chat == pytest.approx(b, abs=SAME_SCORE)


def test_errors_raise_unless_an_error_score_is_set(server):
    bad = {"address": server.address, "evaluator": "no-such-evaluator"}
    with pytest.raises(InvalidArgument, match="no-such-evaluator"):
        load_like_verl("compute_score", bad)(data_source="d", solution_str=SOLUTION, ground_truth="72",
                                             extra_info=gsm8k_extra_info(0))
    lenient = load_like_verl("compute_score", {**bad, "error_score": -1.0, "return_dict": True})
    got = lenient(data_source="d", solution_str=SOLUTION, ground_truth="72", extra_info=gsm8k_extra_info(0))
    assert got["score"] == -1.0 and got["retrace_failed"] == 1.0
    # No verdict is made up for it: -1 would read "the trace holds", 0.0 a real trace score.
    assert all(math.isnan(got[k]) for k in ("first_error_index", "step_count", "trace_score"))


@pytest.mark.parametrize("name", ["compute_score", "compute_score_async", "compute_score_batch"])
def test_an_error_score_must_be_flagged(server, name):
    # A bare float stand-in would pass for a verdict's reward, so error_score needs return_dict.
    fn = load_like_verl(name, {"address": server.address, "error_score": 0.0})
    with pytest.raises(ValueError, match="error_score needs return_dict=True"):
        if name == "compute_score_batch":
            fn(data_sources=["d"], solution_strs=[SOLUTION], ground_truths=["72"], extra_infos=[gsm8k_extra_info(0)])
        else:
            result = fn(data_source="d", solution_str=SOLUTION, ground_truth="72", extra_info=gsm8k_extra_info(0))
            if inspect.iscoroutine(result):
                asyncio.run(result)


def test_a_failed_sample_in_a_batch(server):
    solutions = [SOLUTION, "word " * 2000, ""]  # judged, too large for the model's context, empty
    args = dict(data_sources=["d"] * 3, solution_strs=solutions, ground_truths=["72"] * 3,
                extra_infos=[gsm8k_extra_info(i) for i in range(3)])
    with pytest.raises(InvalidArgument, match="context"):
        load_like_verl("compute_score_batch", {"address": server.address})(**args)
    fn = load_like_verl("compute_score_batch", {"address": server.address, "error_score": 0.0, "return_dict": True})
    ok, failed, empty = fn(**args)
    assert ok.keys() == failed.keys() == empty.keys()
    assert ok["retrace_failed"] == 0.0 and ok["step_count"] == 3 and 0.0 < ok["score"] <= 1.0
    assert failed["retrace_failed"] == 1.0 and failed["score"] == 0.0 and math.isnan(failed["trace_score"])
    assert empty["retrace_failed"] == 0.0 and empty["score"] == 0.0 and empty["step_count"] == 0


def test_an_unreachable_server_raises_in_the_reward_loop():
    fn = load_like_verl("compute_score_async", {"address": f"127.0.0.1:{free_port()}", "retries": 0, "timeout": 5})
    with pytest.raises(Unavailable):
        asyncio.run(fn(data_source="d", solution_str=SOLUTION, ground_truth="72", extra_info=gsm8k_extra_info(0)))


def test_a_misspelt_reward_kwarg_is_warned_about(server, caplog):
    fn = load_like_verl("compute_score", {"address": server.address, "use_groundtruth": True})
    with caplog.at_level("WARNING"):
        fn(data_source="d", solution_str=SOLUTION, ground_truth="72", extra_info=gsm8k_extra_info(0),
           reward_router_address=None)
    assert "'use_groundtruth'" in caplog.text
    assert "reward_router_address" not in caplog.text
