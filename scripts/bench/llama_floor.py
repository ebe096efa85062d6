"""How far llama-server's step scores move against themselves, on one GGUF: the floor under any
comparison of another server's scores with llama-server's.

Starts llama-server on GGUF once per configuration below and scores the first --limit traces of
a ProcessBench split with the procedure `retrace bench` drives it by (ProcessBench's RLHFlow
procedure, chat-lm's words: for each step k one chat request holding the conversation up to step
k, every earlier assistant turn "+", `max_tokens: 1`, the score the softmax of the '+' and '-'
logprobs). Each configuration is compared with the first, llama-server as users run it:

- default: f16 KV cache, each request reusing the prompt cache of the one before;
- no-prompt-cache: the same, every prompt computed whole (`--no-cache-prompt`);
- f32-kv: an f32 KV cache (`-ctk f32 -ctv f32`), prompt cache on;
- ubatch-32: prompts computed in physical batches of 32 tokens (`-ub 32`), which changes how
  many rows each of its matrix products sees.

Prints, per configuration, the steps within --tolerance (default 5e-3) of the default, the median
and largest difference, and the first errors (score < 0.5) that agree. Standard library only.

    python3 -m scripts.bench.llama_floor --llama ~/.cache/retrace/llama-server/bin/llama-server \
        --gguf ~/.cache/retrace/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \
        --data tests/fixtures/processbench/gsm8k.json --limit 16
"""

import argparse
import json
import math
import os
import statistics
import subprocess

from scripts.bench.score_stability import post
from scripts.lib.common import free_port, wait_http

# The words chat-lm scores with (src/prm/format.rs: CHAT_LM_INSTRUCTION), as the bench sends them.
INSTRUCTION = (
    "You check a solution to a problem one step at a time. After each step, reply with a single "
    "character: + if the step is correct, - if it contains an error."
)

CONFIGS = [
    ("default", []),
    ("no-prompt-cache", ["--no-cache-prompt"]),
    ("f32-kv", ["-ctk", "f32", "-ctv", "f32"]),
    ("ubatch-32", ["-ub", "32"]),
]


def start(llama, gguf, extra, threads, log):
    port = free_port()
    cmd = [llama, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", "8192",
           "-np", "1", "-t", str(threads), "--jinja", *extra]
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health", 120, proc, log.name)
    return proc, base


def step_score(top):
    find = {e["token"]: e["logprob"] for e in top}
    plus, minus = find.get("+"), find.get("-")
    if plus is not None and minus is not None:
        return 1.0 / (1.0 + math.exp(minus - plus))
    return {(True, False): 1.0, (False, True): 0.0}.get((plus is not None, minus is not None), 0.5)


def score(base, trace, top_logprobs):
    messages = [{"role": "system", "content": INSTRUCTION}]
    scores = []
    for k, step in enumerate(trace["steps"]):
        content = f"Question: {trace['problem']}\n\nStep: {step}" if k == 0 else f"Step: {step}"
        messages.append({"role": "user", "content": content})
        reply = post(base + "/v1/chat/completions", {
            "messages": messages, "max_tokens": 1, "temperature": 0.0,
            "logprobs": True, "top_logprobs": top_logprobs,
        })
        scores.append(step_score(reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]))
        messages.append({"role": "assistant", "content": "+"})
    return scores


def first_error(scores):
    return next((i for i, s in enumerate(scores) if s < 0.5), -1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", required=True, help="the llama-server binary")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--data", required=True, help="a ProcessBench split's JSON")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--tolerance", type=float, default=5e-3)
    ap.add_argument("--top-logprobs", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    with open(args.data) as f:
        traces = json.load(f)[: args.limit]
    runs = {}
    with open("llama-floor.log", "w") as log:
        for name, extra in CONFIGS:
            proc, base = start(args.llama, args.gguf, extra, args.threads, log)
            try:
                runs[name] = [score(base, t, args.top_logprobs) for t in traces]
            finally:
                proc.terminate()
                proc.wait()
    ref = runs["default"]
    steps = sum(len(s) for s in ref)
    print(f"{len(traces)} traces, {steps} steps; each configuration against the default")
    print()
    print("| configuration | steps within %g | median difference | max difference | first errors equal |"
          % args.tolerance)
    print("|---|---:|---:|---:|---:|")
    for name, _ in CONFIGS[1:]:
        diffs = [abs(a - b) for r, o in zip(ref, runs[name]) for a, b in zip(r, o)]
        within = sum(d <= args.tolerance for d in diffs)
        equal = sum(first_error(r) == first_error(o) for r, o in zip(ref, runs[name]))
        print(f"| {name} | {within}/{steps} | {statistics.median(diffs):.1e} | {max(diffs):.1e} "
              f"| {equal}/{len(traces)} |")


if __name__ == "__main__":
    main()
