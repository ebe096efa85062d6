"""AReaL adapter: a process-reward scorer backed by retrace, with step scores placed on tokens.

AReaL (docs/en/algorithms/prm.md, areal/reward/prm/runner.py) scores each generated turn with a
scorer's `async evaluate(interaction, ctx)`: a scalar is broadcast over the turn's output
tokens, a dense tensor of shape [interaction.model_response.output_len] keeps its positions, and
None or an exception rejects the trajectory (its whole group); an intentional zero must be 0.0.
AReaL loads only subclasses of its BaseScorer, which imports torch. This module imports neither:
RetraceScorer returns a float or a list of floats, and a few-line BaseScorer subclass wraps the
list in a tensor (clients/python/README.md, "AReaL").

A turn is read as trl.py reads a conversational sample: the question is the last user message of
`interaction.messages`, and the turn's text goes whole to the server, which segments it into
steps. The text is the turn's output tokens as the tokenizer decodes them when it can decode,
else the content of the turn's assistant messages. Dense mode (the default) puts each step's
score on the token that holds the step's last character and 0.0 on every other token: the
server's step spans are byte offsets into the text, turned into characters here, then into token
positions. Those positions must be the policy's own tokens, and encoding the decoded text again
need not give them back (a policy may sample a split of "12" into "1", "2" that the tokenizer
would never produce), so when the turn's output token ids are known, each token's span is read
by decoding the ids incrementally (decoded_spans). Only where that fails is the text encoded
again, and its offset mapping is used only if the encoding gives back exactly the turn's ids.
`scalar=True` returns the trace's reward under `reward` ("trace_score" by default) instead.

A turn with no verdict (the server refused it, ran out of time or could not be reached; a prompt
with no user message; a step that lands on no token of the turn; token ids the tokenizer can
place neither by decoding nor by encoding the text again) gives None, so AReaL rejects the
trajectory instead of training on a stand-in 0.0 or on scores shifted onto other tokens. An
empty completion gets `empty_reward` (0.0, None to reject it), as in trl.py and /get_reward.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Sequence

from . import _chat
from ._per_loop import PerLoop
from .aio import AsyncClient
from .errors import RetraceError
from .models import Verdict
from .rewards import check_rule
from .rewards import reward as apply_rule

log = logging.getLogger("retrace_client.areal")


# Tokens decoded ahead of the new ones, so that a token decodes as it does inside the text: a
# SentencePiece decoder drops the space of a text's first "▁word", and a byte-level one shows
# the tail of a character split over tokens as U+FFFD without the bytes before it.
_DECODE_CONTEXT = 4
# Tokens that may add no text of their own before decoding gives up: a character's UTF-8 bytes,
# at most 4, each its own token, with room for a decoder that joins a few more.
_DECODE_PENDING_MAX = 16


def _encode(tokenizer: Any, text: str) -> tuple[list[int] | None, list[tuple[int, int]]]:
    """`text`'s token ids (None from a plain function, which gives spans only) and their spans."""
    if inspect.isroutine(tokenizer) or isinstance(tokenizer, functools.partial):
        ids, spans = None, tokenizer(text)
    else:
        encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        ids, spans = [int(i) for i in encoded["input_ids"]], encoded["offset_mapping"]
    return ids, [(int(start), int(end)) for start, end in spans]


def token_offsets(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    """Each token's (start, end) character span in `text`, as the tokenizer encodes it. A plain
    function is called as `tokenizer(text)` and returns the spans; a tokenizer object (a Hugging
    Face one) is called as `tokenizer(text, return_offsets_mapping=True,
    add_special_tokens=False)` and its "offset_mapping" read."""
    return _encode(tokenizer, text)[1]


def decoded_spans(decode: Any, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]] | None:
    """`decode(ids)` and each token's (start, end) character span in it, read by decoding the ids
    incrementally: a token's span is the text it adds to the few tokens before it. Tokens that add
    no text until a later one completes it (the bytes of one character) all get that text's span,
    as a Hugging Face offset mapping gives them. None when the pieces do not add up to
    `decode(ids)` (a decoder whose output is not a sum of its tokens' parts), or when too many
    tokens in a row add no text."""
    ids = list(ids)
    # text: the pieces so far; done: the tokens they cover; before: what decoding ids[start:done] gives.
    text, spans, done, start, before = "", [], 0, 0, ""
    for i in range(len(ids)):
        after = decode(ids[start : i + 1])
        complete = after.startswith(before) and not after.endswith("\ufffd")
        if not complete and i + 1 < len(ids):
            if i + 1 - done > _DECODE_PENDING_MAX:
                return None
            continue
        if not after.startswith(before):
            return None
        piece = after[len(before) :]
        spans.extend([(len(text), len(text) + len(piece))] * (i + 1 - done))
        text += piece
        done = i + 1
        start = max(0, done - _DECODE_CONTEXT)
        before = decode(ids[start:done])
    if text != decode(ids):
        return None
    return text, spans


def _char_of_byte(text: str) -> list[int]:
    """table[b]: the index of the character holding byte b of text's UTF-8 form; table[-1] = len(text)."""
    table: list[int] = []
    for i, ch in enumerate(text):
        table.extend([i] * len(ch.encode("utf-8")))
    table.append(len(text))
    return table


def _token_of_char(spans: Sequence[tuple[int, int]], n_chars: int) -> list[int]:
    """owner[c]: the token whose span holds character c, the later one where spans overlap (a
    character split over byte-level tokens); for a character no span holds, the token before it;
    -1 before the first token."""
    owner = [-1] * n_chars
    for t, (start, end) in enumerate(spans):
        for c in range(max(start, 0), min(end, n_chars)):
            owner[c] = t
    for c in range(1, n_chars):
        if owner[c] < 0:
            owner[c] = owner[c - 1]
    return owner


def step_rewards(verdict: Verdict, text: str, spans: Sequence[tuple[int, int]], length: int) -> list[float] | None:
    """`length` rewards: each step's score at the token holding its last character (the lower
    score where two steps end on one token), 0.0 elsewhere. `text` is the text the server judged,
    `spans` the tokens' character spans in it (or in a text it begins). None when a step ends
    on no token below `length`."""
    char_of = _char_of_byte(text)
    owner = _token_of_char(spans, len(text))
    out = [0.0] * length
    placed: set[int] = set()
    for step in verdict.steps:
        last = char_of[step.end] - 1 if 0 < step.end < len(char_of) else -1
        t = owner[last] if last >= 0 else -1
        if not 0 <= t < length:
            return None
        out[t] = min(out[t], step.score) if t in placed else float(step.score)
        placed.add(t)
    return out


class RetraceScorer:
    """Scores AReaL turns with retrace; safe to share between concurrent sessions and loops.

    address: the server (or a list, balanced). tokenizer: what maps the turn's text to token
        positions, needed in dense mode. With a `decode` method it turns the output tokens into
        the text and gives each token's span (decoded_spans); otherwise, or where decoding does
        not add up, the text is encoded again (token_offsets), and a Hugging Face-like
        tokenizer's ids must then match the turn's. A plain function gives spans only, which
        are taken as they are.
    scalar: True returns one reward per turn (AReaL broadcasts it) instead of dense rewards.
    reward: the scalar's rule ("trace_score", "correct", "prefix"; see retrace_client.rewards).
    empty_reward: the reward of an empty completion (None rejects the trajectory).
    timeout, retries: per turn, as AReaL asks of a scorer's external calls.
    """

    name = "retrace"

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        evaluator: str = "",
        *,
        tokenizer: Any = None,
        scalar: bool = False,
        reward: str = "trace_score",
        threshold: float | None = None,
        empty_reward: float | None = 0.0,
        token: str | None = None,
        tls: bool = False,
        root_certificates: str | bytes | None = None,
        timeout: float | None = 60.0,
        retries: int = 3,
    ):
        check_rule(reward)
        if not scalar and tokenizer is None:
            raise ValueError("dense rewards need a tokenizer to place step ends on tokens: "
                             "pass tokenizer=, or scalar=True")
        self.evaluator, self.threshold, self.tokenizer = evaluator, threshold, tokenizer
        self.scalar, self.reward, self.empty_reward = scalar, reward, empty_reward
        kwargs = dict(addresses=address, token=token, tls=tls, root_certificates=root_certificates)
        kwargs.update(timeout=timeout, retries=retries)
        self._clients = PerLoop(lambda: AsyncClient(**kwargs))

    async def evaluate(self, interaction: Any, ctx: Any = None) -> float | list[float] | None:
        """AReaL's scorer call: the turn's reward, or None when it has no verdict."""
        text = self.turn_text(interaction)
        if text is None:
            log.warning("retrace scorer: the turn has no output text; it gets None (its trajectory is rejected)")
            return None
        response = getattr(interaction, "model_response", None)
        prompt = getattr(interaction, "messages", None) or getattr(interaction, "input_data", "")
        tokens = getattr(response, "output_tokens", None)
        return await self.score(prompt, text, getattr(response, "output_len", None), output_tokens=tokens)

    def turn_text(self, interaction: Any) -> str | None:
        """The turn's output tokens decoded (given a tokenizer with `decode`), else its assistant content."""
        tokens = getattr(getattr(interaction, "model_response", None), "output_tokens", None)
        decode = getattr(self.tokenizer, "decode", None)
        if decode is not None and tokens is not None:
            return decode(list(tokens))
        try:
            return _chat.assistant_text(getattr(interaction, "output_message_list", None) or [])
        except ValueError:
            return None

    async def score(
        self,
        prompt: Any,
        completion: str,
        output_len: int | None = None,
        *,
        output_tokens: Sequence[int] | None = None,
    ) -> float | list[float] | None:
        """The reward of `completion` (a turn's text) to `prompt` (a string or chat messages):
        dense, `output_len` floats (default: one per output token, else as many as the tokenizer
        gives), or a scalar. `output_tokens`, the turn's token ids when known, are the tokens
        the dense scores are placed on (see the class's `tokenizer`)."""
        try:
            question = _chat.question_of(prompt)
        except ValueError as e:
            log.warning("retrace scorer: the turn is unreadable (%s); it gets None (its trajectory is rejected)", e)
            return None
        text = _chat.strip_end_markers(completion)
        if not text.strip():
            return None if self.empty_reward is None else float(self.empty_reward)
        verdict = await self._verdict(question, text)
        if verdict is None:
            return None
        if self.scalar:
            return apply_rule(verdict, self.reward)
        return self._dense(verdict, completion, text, output_len, output_tokens)

    async def _verdict(self, question: str, text: str) -> Verdict | None:
        client = self._clients.get()
        try:
            return await client.evaluate(question, text=text, evaluator=self.evaluator, threshold=self.threshold)
        except RetraceError as e:
            log.warning("retrace scorer: the turn got no verdict; it gets None (its trajectory is rejected): %s", e)
            return None

    def _dense(
        self, verdict: Verdict, completion: str, text: str, output_len: int | None, output_tokens: Sequence[int] | None
    ) -> list[float] | None:
        if not verdict.steps:
            raise ValueError(f"evaluator {verdict.evaluator!r} gives no step scores; use scalar=True")
        spans = self._spans(completion, output_tokens)
        if spans is None:
            return None
        if output_len is not None:
            length = output_len
        else:
            length = len(spans) if output_tokens is None else len(output_tokens)
        out = step_rewards(verdict, text, spans, length) if len(spans) <= length else None
        if out is None:
            log.warning(
                "retrace scorer: the tokenizer gives %d tokens for the turn's text and the turn has %d, "
                "so its steps can't be placed; it gets None (its trajectory is rejected)",
                len(spans),
                length,
            )
        return out

    def _spans(self, completion: str, output_tokens: Sequence[int] | None) -> list[tuple[int, int]] | None:
        """The character spans in `completion` of the tokens the dense scores go on: the turn's
        own tokens where known, or the tokenizer's encoding of the text where that is all there
        is. None (logged) when the turn's tokens can't be placed.

        A mismatch gives None rather than raising, as every other turn that can't be scored
        does: the tokenizer is fine for the other turns, and AReaL rejects this one's
        trajectory either way; a ValueError stays for what no turn could get past."""
        if output_tokens is None:
            return token_offsets(self.tokenizer, completion)
        ids = [int(i) for i in output_tokens]
        decode = getattr(self.tokenizer, "decode", None)
        if decode is not None:
            decoded = decoded_spans(decode, ids)
            if decoded is not None and decoded[0] == completion:
                return decoded[1]
        encoded, spans = _encode(self.tokenizer, completion)
        if encoded is not None and encoded != ids[: len(encoded)]:
            # Tokens past the encoding (an end-of-turn id that decodes to nothing) get 0.0, as
            # ever; a difference inside it would put scores on the wrong tokens.
            at = next((k for k, (a, b) in enumerate(zip(encoded, ids)) if a != b), min(len(encoded), len(ids)))
            log.warning(
                "retrace scorer: encoding the turn's text again gives other tokens than the turn's "
                "own (%d tokens against %d, first different at token %d), so its steps can't be "
                "placed; it gets None (its trajectory is rejected)",
                len(encoded),
                len(ids),
                at,
            )
            return None
        return spans

    async def aclose(self) -> None:
        """Closes the running loop's client (AReaL's scorer cleanup hook)."""
        client = self._clients.pop()
        if client is not None:
            await client.close()
