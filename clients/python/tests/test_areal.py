"""retrace_client.areal called as AReaL's PRM runner calls a scorer.

areal/reward/prm/runner.py, PRMRunner.run: `await scorer.evaluate(interaction, ctx)` per turn,
where interaction is an InteractionWithTokenLogpReward (areal/experimental/openai/types.py):
`messages` (the turn's prompt), `output_message_list` (its assistant messages) and
`model_response` (`output_tokens`, `output_len`). A float is broadcast over the turn's tokens, a
dense result must have output_len entries, and None rejects the trajectory. The tokenizers here
are fakes: a plain offsets function and a Hugging Face-like object with decode.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from fake_judge import SLOW_S
from helpers import QUESTION, SAME_SCORE
from retrace_client import Client, StepVerdict, Verdict
from retrace_client.areal import RetraceScorer, decoded_spans
from retrace_client.testing import free_port

# Non-ASCII on purpose: the server's step spans are bytes, token spans characters.
TEXT = "3×4 = 12.\n\n2+12 = 14.\n\nThé answer is 14."
# An address nothing listens on, for scorers that never call the server.
DEAD = "127.0.0.1:1"
_TOKEN = re.compile(r"<\|im_end\|>|\s+|\w+|[^\w\s]")


def word_offsets(text: str) -> list[tuple[int, int]]:
    """A tokenizer as a plain function: words, runs of whitespace, single symbols, <|im_end|>."""
    return [m.span() for m in _TOKEN.finditer(text)]


class FakeTokenizer:
    """The same tokens behind Hugging Face's call and decode signatures."""

    def __init__(self):
        self.words: list[str] = []

    def _id(self, word: str) -> int:
        if word not in self.words:
            self.words.append(word)
        return self.words.index(word)

    def __call__(self, text, return_offsets_mapping=False, add_special_tokens=True):
        matches = list(_TOKEN.finditer(text))
        bos = [(0, 0)] if add_special_tokens else []
        out = {"input_ids": [self._id(m.group()) for m in matches]}
        if return_offsets_mapping:
            out["offset_mapping"] = bos + [m.span() for m in matches]
        return out

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)


def step_end_tokens(text: str, verdict) -> list[int]:
    """The token holding each step's last character, computed apart from the adapter."""
    spans = word_offsets(text)
    ends = []
    for step in verdict.steps:
        last = len(text.encode()[: step.end].decode()) - 1
        ends.append(next(t for t, (s, e) in enumerate(spans) if s <= last < e))
    return ends


def assert_dense(got, want_len: int, text: str, verdict) -> None:
    assert isinstance(got, list) and len(got) == want_len
    ends = step_end_tokens(text, verdict)
    assert len(set(ends)) == len(verdict.steps) == 3
    for t, step in zip(ends, verdict.steps):
        assert got[t] == pytest.approx(step.score, abs=SAME_SCORE)
    assert all(r == 0.0 for t, r in enumerate(got) if t not in ends)


def interaction(tokenizer: FakeTokenizer, text: str, prompt=None, with_tokens=True) -> SimpleNamespace:
    tokens = tokenizer(text + "<|im_end|>")["input_ids"] if with_tokens else []
    response = SimpleNamespace(output_tokens=tokens, output_len=len(tokens)) if with_tokens else None
    messages = prompt if prompt is not None else [
        {"role": "system", "content": "Reason step by step."},
        {"role": "user", "content": QUESTION},
    ]
    return SimpleNamespace(messages=messages, output_message_list=[{"role": "assistant", "content": text}],
                           model_response=response)


async def test_dense_rewards_sit_on_step_ends(server):
    with Client(server.address) as c:
        verdict = c.evaluate(QUESTION, text=TEXT)
    scorer = RetraceScorer(server.address, tokenizer=word_offsets)
    n = len(word_offsets(TEXT))
    # One more token than the text holds: an end-of-turn token the text lacks gets 0.0.
    got = await scorer.score(QUESTION, TEXT, output_len=n + 1)
    assert_dense(got, n + 1, TEXT, verdict)
    assert got[-1] == 0.0
    assert await scorer.score(QUESTION, TEXT) == pytest.approx(got[:n], abs=SAME_SCORE)
    await scorer.aclose()


async def test_an_interaction_like_the_prm_runner(server):
    tokenizer = FakeTokenizer()
    turn = interaction(tokenizer, TEXT)
    scorer = RetraceScorer(server.address, tokenizer=tokenizer)
    got = await scorer.evaluate(turn, {"messages": turn.messages})
    with Client(server.address) as c:
        verdict = c.evaluate(QUESTION, text=TEXT)
    # The output tokens decode to TEXT + "<|im_end|>": the end marker is not sent, and its token gets 0.0.
    assert scorer.turn_text(turn) == TEXT + "<|im_end|>"
    assert_dense(got, turn.model_response.output_len, TEXT, verdict)
    assert got[-1] == 0.0
    # Without token ids, the text is the assistant content, and the length the tokenizer's.
    plain = interaction(tokenizer, TEXT, with_tokens=False)
    got_plain = await RetraceScorer(server.address, tokenizer=tokenizer).evaluate(plain)
    assert got_plain == pytest.approx(got[:-1], abs=SAME_SCORE)


async def test_scalar_mode_is_the_trace_score(server):
    with Client(server.address) as c:
        verdict = c.evaluate(QUESTION, text=TEXT)
    got = await RetraceScorer(server.address, scalar=True).score([{"role": "user", "content": QUESTION}], TEXT)
    assert isinstance(got, float) and got == pytest.approx(verdict.trace_score, abs=SAME_SCORE)
    correct = await RetraceScorer(server.address, scalar=True, reward="correct").score(QUESTION, TEXT)
    assert correct == (1.0 if verdict.correct else 0.0)


@pytest.mark.parametrize("scalar", [False, True])
async def test_a_turn_without_a_verdict_gets_none(server, scalar, caplog):
    opts = dict(tokenizer=word_offsets, scalar=scalar)
    dead = f"127.0.0.1:{free_port()}"
    cases = [
        (RetraceScorer(server.address, "no-such-evaluator", **opts), QUESTION, TEXT),  # refused
        (RetraceScorer(dead, retries=0, timeout=5, **opts), QUESTION, TEXT),  # unreachable
        (RetraceScorer(server.address, **opts), QUESTION, "word " * 2000),  # past the model's context
        (RetraceScorer(server.address, **opts), "   ", TEXT),  # the server refuses an empty question
        (RetraceScorer(server.address, **opts), [{"role": "system", "content": "no user"}], TEXT),  # unreadable
    ]
    with caplog.at_level("WARNING", logger="retrace_client.areal"):
        for scorer, prompt, text in cases:
            assert await scorer.score(prompt, text, output_len=4000) is None
    assert caplog.text.count("gets None") == len(cases)


async def test_a_judge_past_its_deadline_gets_none(server):
    scorer = RetraceScorer(server.address, "judge", scalar=True, timeout=SLOW_S / 3, retries=0)
    assert await scorer.score(QUESTION, "3*4 = 12.\n\nSLOW 2+12 = 14.") is None


async def test_turns_the_tokens_cannot_place_get_none(server):
    scorer = RetraceScorer(server.address, tokenizer=FakeTokenizer())
    # Fewer output tokens than the text's: the steps can't be placed.
    assert await scorer.score(QUESTION, TEXT, output_len=3) is None
    # No output tokens and no assistant message: no text to judge.
    empty = SimpleNamespace(messages=[{"role": "user", "content": QUESTION}], output_message_list=[],
                            model_response=None)
    assert await scorer.evaluate(empty, {}) is None


async def test_an_empty_completion_gets_empty_reward_without_a_call():
    dead = f"127.0.0.1:{free_port()}"
    assert await RetraceScorer(dead, tokenizer=word_offsets).score(QUESTION, " <|im_end|>", output_len=3) == 0.0
    assert await RetraceScorer(dead, scalar=True, empty_reward=-1.0).score(QUESTION, "") == -1.0
    assert await RetraceScorer(dead, scalar=True, empty_reward=None).score(QUESTION, "\n") is None


def test_options_are_checked_up_front():
    with pytest.raises(ValueError, match="tokenizer"):
        RetraceScorer("127.0.0.1:1")
    with pytest.raises(ValueError, match="unknown reward rule"):
        RetraceScorer("127.0.0.1:1", scalar=True, reward="min")


# -- the policy's own tokens ----------------------------------------------------------------------
# A policy samples token ids, and encoding their decoded text again need not give them back: here
# it wrote "12" as "1", "2", which the tokenizer encodes as one token. Scores placed through the
# encoding would land one token early on every later step. These tests need no server: the
# verdict is made up, with the byte spans the server gives.


def blank_line_verdict(text: str, scores: list[float]) -> Verdict:
    """A verdict on `text` with one step per blank-line-separated part, spans in UTF-8 bytes."""
    steps, at = [], 0
    for part, score in zip(text.split("\n\n"), scores):
        start = text.index(part, at)
        at = start + len(part)
        steps.append(StepVerdict(part, score, len(text[:start].encode()), len(text[:at].encode())))
    return Verdict(id="", evaluator="made-up", first_error_index=-1, category="none", steps=steps,
                   trace_score=min(scores), rationale="", threshold=0.5, path="prm")


SCORES = [0.9, 0.6, 0.3]


def with_verdict(scorer: RetraceScorer, verdict: Verdict) -> RetraceScorer:
    """`scorer` answering every turn with `verdict` instead of asking a server."""

    async def made_up(question, text):
        return verdict

    scorer._verdict = made_up
    return scorer


def policy_pieces(text: str) -> list[str]:
    """`text`'s word pieces as a policy sampled them: the first "12" split into "1", "2"."""
    pieces = [m.group() for m in _TOKEN.finditer(text)]
    i = pieces.index("12")
    return pieces[:i] + ["1", "2"] + pieces[i + 1 :]


def ends_in(pieces: list[str], text: str, verdict: Verdict) -> list[int]:
    """The index of the piece holding each step's last character."""
    bounds, at = [], 0
    for p in pieces:
        bounds.append((at, at + len(p)))
        at += len(p)
    return [next(t for t, (s, e) in enumerate(bounds) if s <= len(text.encode()[: st.end].decode()) - 1 < e)
            for st in verdict.steps]


async def test_dense_scores_sit_on_the_policys_own_tokens():
    tokenizer = FakeTokenizer()
    pieces = policy_pieces(TEXT) + ["<|im_end|>"]
    ids = [tokenizer._id(p) for p in pieces]
    assert tokenizer(TEXT + "<|im_end|>")["input_ids"] != ids, "the encoding must differ for this test to mean anything"
    verdict = blank_line_verdict(TEXT, SCORES)
    turn = SimpleNamespace(messages=[{"role": "user", "content": QUESTION}], output_message_list=[],
                           model_response=SimpleNamespace(output_tokens=ids, output_len=len(ids)))
    got = await with_verdict(RetraceScorer(DEAD, tokenizer=tokenizer), verdict).evaluate(turn)
    ends = ends_in(pieces, TEXT, verdict)
    assert ends != step_end_tokens(TEXT, verdict), "where the encoding would have put them"
    assert got == [SCORES[ends.index(t)] if t in ends else 0.0 for t in range(len(ids))]


class EncodeOnly:
    """A Hugging Face-like tokenizer without decode: the turn's text is its assistant content."""

    def __init__(self):
        self._inner = FakeTokenizer()

    def __call__(self, *args, **kwargs):
        return self._inner(*args, **kwargs)


async def test_an_encoding_that_differs_from_the_policys_tokens_is_refused(caplog):
    tokenizer = EncodeOnly()
    verdict = blank_line_verdict(TEXT, SCORES)
    scorer = with_verdict(RetraceScorer(DEAD, tokenizer=tokenizer), verdict)

    def turn(ids):
        return SimpleNamespace(messages=[{"role": "user", "content": QUESTION}],
                               output_message_list=[{"role": "assistant", "content": TEXT}],
                               model_response=SimpleNamespace(output_tokens=ids, output_len=len(ids)))

    split = [tokenizer._inner._id(p) for p in policy_pieces(TEXT) + ["<|im_end|>"]]
    with caplog.at_level("WARNING", logger="retrace_client.areal"):
        assert await scorer.evaluate(turn(split)) is None
    assert "other tokens than the turn's own" in caplog.text and "gets None" in caplog.text
    # Where the encoding gives back the turn's ids (the end-of-turn id past the text aside), it places the steps.
    same = tokenizer(TEXT + "<|im_end|>")["input_ids"]
    got = await scorer.evaluate(turn(same))
    assert_dense(got, len(same), TEXT, verdict)
    assert got[-1] == 0.0


def test_decoded_spans_follow_the_decoder():
    # Byte-level: "×" and "é" are two tokens each; both hold the whole character, and nothing
    # of the U+FFFD a lone byte decodes to is left in the text.
    text = "3×4 = 12. Thé"
    byte_ids = list(text.encode())
    got, spans = decoded_spans(lambda ids: bytes(ids).decode("utf-8", errors="replace"), byte_ids)
    assert got == text
    assert spans[1] == spans[2] == (1, 2) and spans[3] == (2, 3)
    assert spans[-2] == spans[-1] == (12, 13)
    assert [text[s:e] for s, e in spans] == [ch for ch in text for _ in ch.encode()]

    # SentencePiece-like: a text's first "▁" is no space, later ones are.
    pieces = ["▁The", "▁answer", "▁is", "▁1", "4", "."]

    def sp_decode(ids):
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    got, spans = decoded_spans(sp_decode, range(len(pieces)))
    assert got == "The answer is 14."
    assert [got[s:e] for s, e in spans] == ["The", " answer", " is", " 1", "4", "."]

    # A decoder whose output is no sum of its tokens' parts gives no spans.
    assert decoded_spans(lambda ids: "".join(pieces[i] for i in ids)[::-1], range(len(pieces))) is None
    assert decoded_spans(sp_decode, []) == ("", [])


def test_decoded_spans_of_a_real_byte_level_tokenizer():
    tokenizers = pytest.importorskip("tokenizers", reason="the `tokenizers` package is not installed")
    from conftest import TINY

    tok = tokenizers.Tokenizer.from_file(str(TINY / "tokenizer.json"))
    text = TEXT + " 日本語 🙂"
    encoding = tok.encode(text, add_special_tokens=False)
    assert len(encoding.ids) > len(text.encode()) / 4
    got, spans = decoded_spans(tok.decode, encoding.ids)
    assert got == text
    assert spans == [tuple(o) for o in encoding.offsets]
