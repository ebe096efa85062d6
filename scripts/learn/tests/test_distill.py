"""The learning loop's own logic: the split that keeps choosing and comparing apart, and the
swap that leaves the serving folder as it was when the reload call fails."""
from types import SimpleNamespace

from scripts.learn import distill
from scripts.lib.common import free_port


def rows(n):
    # Three traces a question: a question's traces must stay on one side.
    return [{"question": f"q{i // 3}", "steps": ["s"], "label": -1} for i in range(n)]


def test_the_candidate_is_compared_on_rows_it_never_chose_on():
    train, select, compare = distill.split(rows(3000), 0.3, max_compare=10_000)
    q = lambda rs: {r["question"] for r in rs}  # noqa: E731
    assert select and compare and train
    assert not q(select) & q(compare)
    assert not (q(select) | q(compare)) & q(train)
    assert len(train) + len(select) + len(compare) == 3000
    # About half of the held-out share each.
    assert 0.35 < len(select) / (len(select) + len(compare)) < 0.65
    # The newest comparison rows, at most max_compare.
    _, _, newest = distill.split(rows(3000), 0.3, max_compare=12)
    assert newest == compare[-12:]


def test_a_reload_call_that_fails_puts_the_serving_head_back(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text('{"serving": true}')
    candidate = tmp_path / "candidate"
    candidate.mkdir()
    (candidate / "config.json").write_text('{"serving": false}')
    setup = SimpleNamespace(head=head, prm="h")
    # A port nothing listens on: the reload call is refused.
    a = SimpleNamespace(http=f"http://127.0.0.1:{free_port()}", token_env=None)
    ok, answer = distill.swap(setup, candidate, tmp_path / "aside", a)
    assert not ok
    assert "reload call failed" in answer["error"]
    assert (head / "config.json").read_text() == '{"serving": true}'
    assert not (tmp_path / "aside").exists()
