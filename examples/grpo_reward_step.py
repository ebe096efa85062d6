"""A simulated GRPO reward step, scored two ways that must agree.

Groups of G = 8 sampled responses per prompt, with ChatML prompts as OpenRLHF builds them, are
scored (a) through the server's HTTP endpoint, `POST /get_reward` with OpenRLHF's remote reward
body `{"query": [prompt + response], "prompts": [prompt], "labels": [label]}`, one sample per
request and all requests at once, and (b) through retrace_client.trl's reward function, one
EvaluateStream burst per group. The server reads the question from the prompt's last user turn
and segments the response into steps, and the adapter does the same, so both score the same
trace: for each reward rule the two lists must agree to within SAME_SCORE.

    python examples/grpo_reward_step.py

Exits non-zero when the two disagree, when the HTTP endpoint fails (404 on /get_reward
included), or when the server has no HTTP endpoint (with $RETRACE_ADDRESS set, name it in
$RETRACE_HTTP_ADDRESS): the comparison is the point, so neither half is ever skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from _server import retrace_server
from retrace_client.trl import reward_function

G = 8
# The two paths batch the same trace with different neighbours, and a trace scored in a batch
# differs from itself alone by f32 rounding (the GEMM's blocking follows the batch's rows);
# different traces differ by far more, so a mix-up still fails.
SAME_SCORE = 1e-5
RULES = ("trace_score", "correct", "prefix")
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
PROBLEMS = [
    ("What is 2+3*4?", "14", ["3*4 = 12.", "2 + 12 = 14.", "The answer is \\boxed{14}."]),
    ("If 3x + 7 = 22, what is x?", "5", ["Subtract 7: 3x = 15.", "Divide by 3: x = 5.", "The answer is \\boxed{5}."]),
    ("A book costs $12 and a pen $3. What do 2 books and 4 pens cost?", "36",
     ["2 books cost 2 * 12 = 24.", "4 pens cost 4 * 3 = 12.", "Together 24 + 12 = 36.", "The answer is \\boxed{36}."]),
]


def chatml_prompt(question: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def sampled_responses(steps: list[str]) -> list[str]:
    """G deterministic 'samples': the right chain, slips in one step, truncations, an empty one."""
    out = []
    for k in range(G):
        s = list(steps)
        if k % 3 == 1:
            s[k % len(s)] = s[k % len(s)].replace("=", "= 1 +", 1)
        if k % 4 == 3:
            s = s[: 1 + k % len(s)]
        out.append("\n\n".join(s))
    out[G - 1] = ""  # an empty rollout: both paths give it the empty reward
    return out


def get_reward(http_address: str, prompt: str, response: str, label: str, rule: str) -> dict:
    """One OpenRLHF-style remote reward request (openrlhf/utils/remote_rm_utils.py's body)."""
    body = {"query": [prompt + response + "<|im_end|>"], "prompts": [prompt], "labels": [label]}
    url = f"http://{http_address}/get_reward" + ("" if rule == "trace_score" else f"?rule={rule}")
    headers = {"Content-Type": "application/json"}
    if os.environ.get("RETRACE_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['RETRACE_TOKEN']}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        raise RuntimeError(f"POST {url} answered HTTP {e.code}: {text}") from None


def http_rewards(http_address: str, samples, rule: str) -> tuple[list[float], list[int]]:
    # One request per sample, all in flight at once, as a trainer's reward workers send them.
    with ThreadPoolExecutor(max_workers=len(samples)) as pool:
        replies = list(pool.map(lambda s: get_reward(http_address, s[0], s[1], s[2], rule), samples))
    for r in replies:
        if not (len(r["rewards"]) == len(r["scores"]) == 1 and set(r["extra_logs"]) >= {"first_error_index", "step_count", "category", "trace_score"}):
            raise RuntimeError(f"/get_reward's reply has the wrong shape: {r}")
    return [r["rewards"][0] for r in replies], [r["extra_logs"]["first_error_index"][0] for r in replies]


def main() -> int:
    samples = []  # (prompt, response, label)
    for question, label, steps in PROBLEMS:
        samples += [(chatml_prompt(question), r, label) for r in sampled_responses(steps)]
    prompts = [s[0] for s in samples]
    completions = [s[1] for s in samples]
    failures = 0
    with retrace_server() as endpoint:
        if endpoint.http_address is None:
            print("FAILED: no HTTP endpoint to compare with (with $RETRACE_ADDRESS, set $RETRACE_HTTP_ADDRESS too)")
            return 1
        for rule in RULES:
            fn = reward_function(endpoint.address, reward=rule)
            # TRL decodes completions with skip_special_tokens=True: no <|im_end|> here.
            trl = asyncio.run(fn(prompts=prompts, completions=completions, completion_ids=None))
            print(f"\n[{rule}] TRL adapter ({len(PROBLEMS)} groups of {G}):")
            for g in range(len(PROBLEMS)):
                print("   ", [None if r is None else round(r, 6) for r in trl[g * G : (g + 1) * G]])
            try:
                http, first_errors = http_rewards(endpoint.http_address, samples, rule)
            except RuntimeError as e:
                failures += 1
                print(f"FAILED [{rule}]: {e}")
                continue
            print(f"[{rule}] POST /get_reward (one sample per request):")
            for g in range(len(PROBLEMS)):
                print("   ", [round(r, 6) for r in http[g * G : (g + 1) * G]])
            print("    first_error_index:", first_errors)
            # `not <=` rather than `>`, so a NaN on either side is a mismatch too.
            bad = [i for i, (a, b) in enumerate(zip(trl, http)) if a is None or not abs(a - b) <= SAME_SCORE]
            if bad:
                failures += 1
                print(f"MISMATCH [{rule}] at samples {bad}: adapter {[trl[i] for i in bad]} vs HTTP {[http[i] for i in bad]}")
            else:
                print(f"[{rule}] the two paths agree on all {len(samples)} samples")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
