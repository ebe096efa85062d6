"""Reads a trainer's prompt and completion as a question and a response text.

The rules are the server's own for POST /get_reward (src/api/http/chat.rs), so a sample scored
through an adapter and through /get_reward is the same trace: the question is the last user
turn of ChatML, Llama 3 or Mistral markup (the whole prompt when it holds none), and trailing
end-of-turn, end-of-text and padding markers are dropped from the response.
"""

from __future__ import annotations

from typing import Any

_USER_TURNS = (
    ("<|im_start|>user\n", "<|im_end|>"),
    ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
    ("[INST]", "[/INST]"),
)

_END_MARKERS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|finetune_right_pad_id|>",
    "</s>",
    "<eos>",
    "<pad>",
    "<end_of_turn>",
    "<｜end▁of▁sentence｜>",
    "<|end|>",
)


def last_user_turn(prompt: str) -> str | None:
    """The content of the last user turn of whichever markup `prompt` uses, or None."""
    best = None
    for opening, end in _USER_TURNS:
        at = prompt.rfind(opening)
        if at >= 0 and (best is None or at + len(opening) > best[0]):
            best = (at + len(opening), end)
    if best is None:
        return None
    rest = prompt[best[0] :]
    cut = rest.find(best[1])
    return rest if cut < 0 else rest[:cut]


def strip_end_markers(response: str) -> str:
    """`response` without the end markers and whitespace it ends with, however many are stacked."""
    s = response.rstrip()
    while True:
        marker = next((m for m in _END_MARKERS if s.endswith(m)), None)
        if marker is None:
            return s
        s = s[: -len(marker)].rstrip()


def _content(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # Multimodal messages carry a list of parts; only the text parts are a trace.
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def question_of(prompt: Any) -> str:
    """A conversational prompt's last user message, or a text prompt's last user turn."""
    if isinstance(prompt, str):
        turn = last_user_turn(prompt)
        return (prompt if turn is None else turn).strip()
    if isinstance(prompt, (list, tuple)):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            raise ValueError("the conversational prompt has no user message")
        return _content(users[-1]).strip()
    raise ValueError(f"a prompt must be a string or a list of messages, not {type(prompt).__name__}")


def assistant_text(messages: Any) -> str:
    """The content of a conversation's assistant messages, joined by blank lines, as written."""
    parts = [_content(m) for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    if not parts:
        raise ValueError("the conversational completion has no assistant message")
    return "\n\n".join(parts)


def response_of(completion: Any) -> str:
    """A text completion, or the content of a conversational completion's assistant messages."""
    if isinstance(completion, str):
        return strip_end_markers(completion)
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        return strip_end_markers(assistant_text(completion))
    raise ValueError(f"a completion must be a string or a list of messages, not {type(completion).__name__}")
