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


def test_no_head_trains_chooses_or_is_compared_on_a_calibration_question(tmp_path, monkeypatch):
    """A round with the cascade's own calibration file (outside the head): its questions are
    left out of every set the round writes, and a seed row on one is refused."""
    import pytest

    from scripts.learn import guarantee
    from scripts.lib.common import read_rows, write_jsonl

    recorded = rows(600)
    cal_file = tmp_path / "cal.jsonl"
    # Calibration rows on questions the recorded stream also holds, on every side of the split.
    write_jsonl(cal_file, recorded[::5])
    head = tmp_path / "head"
    head.mkdir()
    g = guarantee.Guarantee.of({"target_agreement": 0.9, "calibration": str(cal_file)}, head, lambda p: p)
    setup = SimpleNamespace(head=head, guarantee=g, prm="h")
    a = SimpleNamespace(work=tmp_path / "work", dev_share=0.5, max_dev=10_000, chunk=50, seed=[],
                        train_arg=[])

    def stop(*_args, **_kw):
        raise RuntimeError("stop before train-head")

    monkeypatch.setattr(distill, "run", stop)
    (head / "config.json").write_text('{"base": "/elsewhere"}')
    with pytest.raises(RuntimeError):
        distill.round_(1, setup, a, "retrace", recorded)
    cal_q = {r["question"] for r in read_rows(cal_file)}
    here = a.work / "round-001"
    for name in ("select.jsonl", "dev.jsonl", "measure.jsonl"):
        assert not {r["question"] for r in read_rows(here / name)} & cal_q, name
    trained = [r for f in sorted((a.work / "train").iterdir()) for r in read_rows(f)]
    assert trained and not {r["question"] for r in trained} & cal_q
    # A seed row on a calibration question is refused.
    seed = tmp_path / "seed.jsonl"
    write_jsonl(seed, recorded[:3])
    a.seed = [seed]
    with pytest.raises(SystemExit, match="seed row"):
        distill.round_(1, setup, a, "retrace", recorded)
