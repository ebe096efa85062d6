"""The TRL adapter reads a text prompt and completion as the server's POST /get_reward does:
for ChatML, Llama 3 and Mistral markup (and no markup), both give the same reward.

Every build of `retrace serve` has the HTTP endpoint with /get_reward, so a server without an
HTTP address, or any error status from /get_reward, 404 included, fails the test."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from helpers import SAME_SCORE
from retrace_client.trl import reward_function

Q = "What is 2+3*4?"
RESPONSE = "3*4 = 12.\n\n2 + 12 = 14.\n\nThe answer is 14."
PROMPTS = {
    "chatml": (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{Q}<|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|>",
    ),
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{Q}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        "<|eot_id|>",
    ),
    "mistral": (f"<s>[INST] {Q} [/INST]", "</s>"),
    "plain": (f"Question: {Q}\nAnswer:", ""),
}


def get_reward(http_address: str, query: str, prompt: str) -> float:
    body = json.dumps({"query": query, "prompts": prompt}).encode()
    req = urllib.request.Request(f"http://{http_address}/get_reward", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.load(resp)["rewards"]
    except urllib.error.HTTPError as e:
        # The body says why (a field it could not read, a missing route); the bare status does not.
        body = e.read().decode(errors="replace")
        raise AssertionError(f"POST /get_reward answered {e.code}: {body}") from e


@pytest.mark.parametrize("markup", sorted(PROMPTS))
def test_adapter_matches_get_reward(server, markup):
    assert server.http_address, "LocalServer found no --http-addr in `retrace serve --help`, which every build has"
    prompt, end = PROMPTS[markup]
    # A single query string is answered with scalars.
    http = get_reward(server.http_address, prompt + RESPONSE + end, prompt)
    fn = reward_function(server.address)
    (adapter,) = asyncio.run(fn(prompts=[prompt], completions=[RESPONSE + end]))
    assert isinstance(http, float)
    assert adapter == pytest.approx(http, abs=SAME_SCORE)
