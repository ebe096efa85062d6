"""retrace_client.trl called exactly as TRL's GRPOTrainer calls a reward function.

trl/trainer/grpo_trainer.py, GRPOTrainer._calculate_rewards:
    keys = [key for key in inputs[0] if key not in ["prompt", "completion", "completion_ids"]]
    reward_kwargs = {key: [example[key] for example in inputs] for key in keys}
    reward_kwargs["trainer_state"] = self.state
    ...
    elif asyncio.iscoroutinefunction(reward_func): async_funcs_info.append(...)
    ...
    output = await func(prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs)
    async_results = asyncio.run_coroutine_threadsafe(_run_async_funcs(), self.async_reward_loop).result()
and the names it logs: self.reward_func_names.append(reward_funcs[i].__name__).
Conversational completions are [{"role": "assistant", "content": ...}] (one message).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from fake_judge import SLOW_S, expected
from helpers import JUDGE_CASES, QUESTION, SAME_SCORE
from retrace_client import Client
from retrace_client.testing import free_port
from retrace_client.trl import reward_function

G = 8
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


@pytest.fixture(scope="module")
def trl_loop():
    """TRL's start_event_loop_in_daemon: a loop running forever in a daemon thread."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True, name="GRPOTrainer-AsyncRewardLoop")
    t.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    t.join()


def call_like_trl(loop, func, prompts, completions, **reward_kwargs):
    completion_ids_list = [[len(c) % 7, 3, 1] for c in completions]
    reward_kwargs["trainer_state"] = object()
    assert asyncio.iscoroutinefunction(func)

    async def _run_async_funcs():
        return await asyncio.gather(
            func(prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs)
        )

    (output,) = asyncio.run_coroutine_threadsafe(_run_async_funcs(), loop).result()
    return output


def group_texts(n: int = G) -> list[str]:
    return [f"3*4 = 12.\n\n2+12 = {13 + i % 3}.\n\nThe answer is {13 + i % 3}." for i in range(n)]


def test_plain_samples_match_the_client(server, trl_loop):
    fn = reward_function(server.address)
    assert fn.__name__ == "retrace_trace_score"
    prompts = [QUESTION] * G
    completions = group_texts()
    got = call_like_trl(trl_loop, fn, prompts, completions, answer=["14"] * G)
    with Client(server.address) as c:
        want = [c.evaluate(QUESTION, text=t).trace_score for t in completions]
    assert got == pytest.approx(want, abs=SAME_SCORE)
    assert all(0.0 <= r <= 1.0 for r in got)


def test_chatml_text_prompts_use_the_last_user_turn(server, trl_loop):
    prompt = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    completions = [t + "<|im_end|>" for t in group_texts(4)]
    got = call_like_trl(trl_loop, reward_function(server.address), [prompt] * 4, completions)
    with Client(server.address) as c:
        want = [c.evaluate(QUESTION, text=t).trace_score for t in group_texts(4)]
    assert got == pytest.approx(want, abs=SAME_SCORE)


@pytest.mark.parametrize("rule", ["trace_score", "correct", "prefix"])
def test_conversational_samples_with_the_judge(server, trl_loop, rule):
    fn = reward_function(server.address, evaluator="judge", reward=rule, name=f"judge_{rule}")
    assert fn.__name__ == f"judge_{rule}"
    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}] for _ in JUDGE_CASES]
    completions = [[{"role": "assistant", "content": "\n\n".join(steps)}] for steps in JUDGE_CASES]
    got = call_like_trl(trl_loop, fn, prompts, completions, answer=["14"] * len(JUDGE_CASES))
    for steps, r in zip(JUDGE_CASES, got):
        index, _ = expected(steps)
        # The judge's step scores are 1 before its first error and 0 from it on (min = 0 or 1).
        want = {
            "trace_score": 1.0 if index == -1 else 0.0,
            "correct": 1.0 if index == -1 else 0.0,
            "prefix": 1.0 if index == -1 else index / len(steps),
        }[rule]
        assert r == pytest.approx(want)


def test_failed_samples_give_none_not_an_exception(server, trl_loop, caplog):
    fn = reward_function(server.address)
    prompts = [
        [{"role": "user", "content": QUESTION}],
        [{"role": "user", "content": "   "}],  # the server refuses an empty question
        [{"role": "system", "content": "no user turn"}],  # unreadable here
        [{"role": "user", "content": QUESTION}],
    ]
    completions = [
        [{"role": "assistant", "content": "3*4 = 12.\n\n2+12 = 14."}],
        [{"role": "assistant", "content": "3*4 = 12."}],
        [{"role": "assistant", "content": "3*4 = 12."}],
        [{"role": "assistant", "content": ""}],  # an empty rollout is worth empty_reward
    ]
    with caplog.at_level("WARNING", logger="retrace_client.trl"):
        got = call_like_trl(trl_loop, fn, prompts, completions)
    assert got[0] is not None and 0.0 <= got[0] <= 1.0
    assert got[1] is None and got[2] is None
    assert got[3] == 0.0
    assert "question" in caplog.text and "no user message" in caplog.text

    everything_fails = reward_function(server.address, evaluator="no-such-evaluator")
    assert call_like_trl(trl_loop, everything_fails, [QUESTION] * 3, group_texts(3)) == [None] * 3


def test_samples_the_server_cannot_judge_give_none(server, trl_loop):
    # Too large for the model's context, and past the batch's deadline: each gets None, never 0.0,
    # while the batch's other samples keep their verdicts' rewards.
    fn = reward_function(server.address)
    got = call_like_trl(trl_loop, fn, [QUESTION] * 3, [group_texts(1)[0], "word " * 2000, ""])
    assert got[0] is not None and 0.0 < got[0] <= 1.0
    assert got[1] is None and got[2] == 0.0
    slow = reward_function(server.address, evaluator="judge", timeout=SLOW_S / 3, retries=0)
    got = call_like_trl(trl_loop, slow, [QUESTION] * 2, ["3*4 = 12.\n\n2+12 = 14.", "3*4 = 12.\n\nSLOW 2+12 = 14."])
    assert got == [1.0, None]


@pytest.mark.parametrize("asynchronous", [True, False])
def test_an_unreachable_server_gives_none_and_only_empties_get_empty_reward(trl_loop, asynchronous):
    dead = f"127.0.0.1:{free_port()}"
    completions = group_texts(2) + [""]
    for empty_reward, want_empty in ((0.0, 0.0), (None, None)):
        fn = reward_function(dead, retries=0, timeout=5, empty_reward=empty_reward, asynchronous=asynchronous)
        if asynchronous:
            got = call_like_trl(trl_loop, fn, [QUESTION] * 3, completions)
        else:
            got = fn(prompts=[QUESTION] * 3, completions=completions, completion_ids=None, trainer_state=None)
        assert got == [None, None, want_empty]


def test_reference_key_sends_the_gold_answer(server, trl_loop, fake_judge):
    fn = reward_function(server.address, evaluator="judge", reference_key="solution")
    call_like_trl(trl_loop, fn, [QUESTION], ["3*4 = 12.\n\n2+12 = 14."], solution=["GOLD-14-XYZ"])
    assert "GOLD-14-XYZ" in fake_judge.prompts()[-1]
    with pytest.raises(ValueError, match="reference_key"):
        call_like_trl(trl_loop, fn, [QUESTION], ["x"], answer=["14"])


def test_same_function_in_fresh_loops_and_sync_mode(server):
    # One reward function object used from several loops (asyncio.run makes a new one each time).
    fn = reward_function(server.address)
    texts = group_texts(3)
    a = asyncio.run(fn(prompts=[QUESTION] * 3, completions=texts, completion_ids=None))
    b = asyncio.run(fn(prompts=[QUESTION] * 3, completions=texts))
    sync_fn = reward_function(server.address, asynchronous=False)
    assert not asyncio.iscoroutinefunction(sync_fn)
    c = sync_fn(prompts=[QUESTION] * 3, completions=texts, completion_ids=[[1]] * 3, trainer_state=None)
    assert a == pytest.approx(b, abs=SAME_SCORE) and a == pytest.approx(c, abs=SAME_SCORE)


def test_bad_rule_is_refused_up_front():
    with pytest.raises(ValueError, match="trace_score, correct, prefix"):
        reward_function("127.0.0.1:1", reward="min")
