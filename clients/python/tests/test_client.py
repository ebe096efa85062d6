"""Client (sync) against a real server: every call, and results checked against a second path
(unary vs stream vs rank) or against what the fake judge was scripted to answer."""

from __future__ import annotations

import pytest

from fake_judge import expected
from helpers import JUDGE_CASES, QUESTION, SAME_SCORE, STEPS, TEXT
from retrace_client import Client, InvalidArgument, Trace, Verdict


@pytest.fixture
def client(server):
    with Client(server.address) as c:
        yield c


def assert_same_verdict(a: Verdict, b: Verdict):
    assert a.first_error_index == b.first_error_index
    assert a.category == b.category
    assert [s.text for s in a.steps] == [s.text for s in b.steps]
    assert [s.score for s in a.steps] == pytest.approx([s.score for s in b.steps], abs=SAME_SCORE)
    assert a.trace_score == pytest.approx(b.trace_score, abs=SAME_SCORE)


def test_health_and_status(client):
    assert client.health() is True
    assert client.health_status() == "SERVING"


def test_each_evaluator_has_its_own_health_service(client):
    # retrace.v1.Evaluator/<name>, as the server publishes it.
    assert client.health_status(evaluator="tiny") == "SERVING"
    assert client.health(evaluator="judge") is True
    assert client.health_status(evaluator="no-such-evaluator") == "SERVICE_UNKNOWN"
    assert client.health(evaluator="no-such-evaluator") is False


def test_list_evaluators(client, fake_judge):
    infos = {e.name: e for e in client.list_evaluators()}
    assert set(infos) == {"tiny", "judge"}
    assert infos["tiny"].kind == "prm" and infos["tiny"].family == "qwen2-math-prm"
    assert infos["tiny"].is_default and not infos["judge"].is_default
    assert infos["judge"].kind == "judge" and infos["judge"].model == "fake-judge"
    assert all(e.ready for e in infos.values())
    assert infos["tiny"].threshold == pytest.approx(0.5)
    assert infos["tiny"].aggregate == "min"


def test_evaluate_prm_steps(client):
    v = client.evaluate(QUESTION, STEPS, id="t1")
    assert v.id == "t1" and v.evaluator == "tiny" and v.path == "prm"
    assert [s.text for s in v.steps] == STEPS
    assert all(0.0 <= s.score <= 1.0 for s in v.steps)
    # The default aggregate is min, and a PRM's first error is the first step under threshold.
    assert v.trace_score == pytest.approx(min(s.score for s in v.steps), abs=1e-6)
    below = [i for i, s in enumerate(v.steps) if s.score < v.threshold]
    assert v.first_error_index == (below[0] if below else -1)
    assert v.category == ("none" if v.first_error_index == -1 else "unspecified")
    assert v.timing.total_s >= v.timing.inference_s >= 0.0


def test_evaluate_text_is_segmented_with_offsets(client):
    v = client.evaluate(QUESTION, text=TEXT)
    assert [TEXT[s.start : s.end] for s in v.steps] == STEPS
    # Segmented text scores the same as the same steps sent as steps.
    assert_same_verdict(v, client.evaluate(QUESTION, STEPS))


def test_threshold_override_decides_first_error(client):
    base = client.evaluate(QUESTION, STEPS)
    for threshold in (0.0, 1.0, base.steps[0].score + 1e-4):
        v = client.evaluate(QUESTION, STEPS, threshold=threshold)
        assert v.threshold == pytest.approx(threshold, abs=1e-6)
        below = [i for i, s in enumerate(v.steps) if s.score < threshold]
        assert v.first_error_index == (below[0] if below else -1)
    assert client.evaluate(QUESTION, STEPS, threshold=0.0).first_error_index == -1
    assert client.evaluate(QUESTION, STEPS, threshold=1.0).first_error_index == 0


@pytest.mark.parametrize("steps", JUDGE_CASES)
def test_evaluate_judge_verdict_is_the_fakes(client, steps):
    v = client.evaluate(QUESTION, steps, evaluator="judge")
    index, category = expected(steps)
    assert (v.first_error_index, v.category) == (index, category)
    assert v.path == "judge" and v.evaluator == "judge"
    assert v.rationale == f"fake review: first error {index}"
    # A single judge sample scores 1 before the first error and 0 from it on.
    want = [1.0 if index == -1 or i < index else 0.0 for i in range(len(steps))]
    assert [s.score for s in v.steps] == want


def test_reference_answer_and_options_reach_the_judge(client, fake_judge):
    client.evaluate("Which is a mammal?", ["A whale breathes air.", "So (B)."], evaluator="judge",
                    options=["shark", "whale"], reference_answer="B-GOLD-ANSWER")
    prompt = fake_judge.prompts()[-1]
    assert "B-GOLD-ANSWER" in prompt
    assert "whale" in prompt and "shark" in prompt


def test_client_default_evaluator(server):
    with Client(server.address, evaluator="judge") as c:
        assert c.evaluate(QUESTION, STEPS).evaluator == "judge"
        assert c.evaluate(QUESTION, STEPS, evaluator="tiny").evaluator == "tiny"


def test_evaluate_many_matches_unary_in_input_order(client):
    items = [
        {"question": QUESTION, "steps": STEPS, "id": "a"},
        Trace(QUESTION, text=TEXT),
        {"question": QUESTION, "steps": JUDGE_CASES[1], "evaluator": "judge"},
        {"question": QUESTION, "steps": ["x = 1.", "y = 2."], "threshold": 0.0},
    ]
    results = client.evaluate_many(items, max_in_flight=2)
    assert [type(r) for r in results] == [Verdict] * 4
    assert results[0].id == "a"
    assert_same_verdict(results[0], client.evaluate(QUESTION, STEPS))
    assert_same_verdict(results[1], client.evaluate(QUESTION, text=TEXT))
    assert results[2].evaluator == "judge" and results[2].first_error_index == expected(JUDGE_CASES[1])[0]
    assert results[3].first_error_index == -1 and results[3].threshold == 0.0


def test_evaluate_many_per_item_errors_and_duplicate_ids(client):
    items = [
        {"question": QUESTION, "steps": STEPS, "id": "same"},
        {"question": QUESTION, "steps": ["fine", "  "], "id": "same"},
        {"question": "", "steps": STEPS, "id": ""},
        {"question": QUESTION, "steps": STEPS, "evaluator": "no-such-evaluator"},
        {"question": QUESTION, "steps": STEPS, "id": "same"},
    ]
    r = client.evaluate_many(items)
    assert isinstance(r[0], Verdict) and r[0].id == "same"
    assert isinstance(r[1], InvalidArgument) and "trace.steps[1]" in r[1].message
    assert isinstance(r[2], InvalidArgument) and "question" in r[2].message
    assert isinstance(r[3], InvalidArgument) and "no-such-evaluator" in r[3].message
    assert isinstance(r[4], Verdict) and r[4].id == "same"
    assert_same_verdict(r[0], r[4])


def test_evaluate_many_bounded_window_many_items(client):
    items = [{"question": QUESTION, "steps": [f"{i} + 1 = {i + 1}.", "Done."], "id": f"i{i}"} for i in range(60)]
    one_at_a_time = client.evaluate_many(items, max_in_flight=1)
    wide = client.evaluate_many(items, max_in_flight=64)
    assert [v.id for v in wide] == [f"i{i}" for i in range(60)]
    for a, b in zip(one_at_a_time, wide):
        assert_same_verdict(a, b)
    assert client.evaluate_many([]) == []


def test_rank_orders_by_trace_score_and_matches_evaluate(client):
    candidates = [TEXT, STEPS, {"steps": ["3*4 = 7.", "2+7 = 9."]}, {"text": "3*4 is 12.\n2+12 is 14."}]
    ranking = client.rank(QUESTION, candidates, id="r1")
    assert ranking.id == "r1" and ranking.evaluator == "tiny"
    assert sorted(ranking.order) == [0, 1, 2, 3]
    scores = [c.verdict.trace_score for c in ranking.ranked]
    assert scores == sorted(scores, reverse=True)
    assert ranking.best.index == ranking.order[0]
    by_index = {c.index: c.verdict for c in ranking.ranked}
    assert by_index[2].id == "r1#2"
    assert_same_verdict(by_index[0], client.evaluate(QUESTION, text=TEXT))
    assert_same_verdict(by_index[1], client.evaluate(QUESTION, STEPS))
    assert_same_verdict(by_index[2], client.evaluate(QUESTION, ["3*4 = 7.", "2+7 = 9."]))


def test_rank_with_the_judge(client):
    ranking = client.rank(QUESTION, JUDGE_CASES, evaluator="judge")
    by_index = {c.index: c.verdict for c in ranking.ranked}
    for i, steps in enumerate(JUDGE_CASES):
        assert by_index[i].first_error_index == expected(steps)[0]
    # Only the error-free case has trace score 1, so it ranks first.
    assert ranking.best.index == 0


def test_shape_errors_are_caught_before_sending(client):
    with pytest.raises(TypeError, match="steps"):
        client.evaluate(QUESTION, "one string, not a list")
    with pytest.raises(TypeError, match="unknown item keys"):
        client.evaluate_many([{"question": QUESTION, "step": ["typo"]}])
