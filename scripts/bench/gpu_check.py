"""The GPU check's stages (scripts/bench/gpu-check.sh runs this): random-weight Qwen2.5-Math-PRM-shaped
checkpoints, retrace's step scores against an independent reference, throughput against a Python
reward server, peak memory. Each stage has its own time limit and writes its result file as soon as
it ends, so a later failure keeps what earlier stages measured.

    python3 -m scripts.bench.gpu_check --mode cuda --retrace BIN --tokenizer DIR --data DIR --out DIR
    python3 -m scripts.bench.gpu_check --mode cpu  ...   # the small f32 checkpoint, retrace on the CPU, numpy reference

cuda mode needs torch + transformers (the reference is transformers' own Qwen2Model with the PRM
head applied in torch, and the Python server is that model in bf16 with sdpa attention on padded
batches, as OpenRLHF's serve_rm and search-and-learn run one). cpu mode needs numpy, tokenizers,
jinja2 (scripts/reference/numpy_decoder.py is the reference; there is no Python server).

Result files under --out: checkpoints.json, exact_f32.json, exact_bf16.json (cuda), throughput.json,
memory.json, summary.md (a table of all of it), and retrace-*.log (the servers' logs).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from scripts.lib.common import free_port

# Qwen2.5-Math-PRM-7B's config.json (docs/prm-formats.md): Qwen2, bf16, untied LM head unused.
BIG = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
           intermediate_size=18944, vocab_size=152064, max_position_embeddings=4096,
           rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=131072, use_sliding_window=False,
           tie_word_embeddings=False, torch_dtype="bfloat16")
SMALL = dict(BIG, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, torch_dtype="float32")
H200_BF16_DENSE_FLOPS = 790e12
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64]


class StageTimeout(Exception):
    pass


def stage(out, name, limit_s, fn, *args):
    """Runs fn under a SIGALRM deadline; writes {name}.json with its result or its error."""
    def on_alarm(*_):
        raise StageTimeout(f"stage {name} passed its {limit_s} s limit")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(limit_s))
    t0 = time.time()
    try:
        res = fn(*args)
        res = {"ok": True, **res}
    except BaseException as e:  # noqa: BLE001 - every failure goes into the result file
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    finally:
        signal.alarm(0)
    res["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"[gpu-check] {name}: {'ok' if res['ok'] else 'FAILED ' + res['error']} ({res['seconds']} s)",
          flush=True)
    return res


# ------------------------------------------------------------------ checkpoints and inputs

def config_json(shape: dict) -> dict:
    return dict(shape, architectures=["Qwen2ForProcessRewardModel"], model_type="qwen2",
                hidden_act="silu", attention_dropout=0.0, bos_token_id=151643,
                eos_token_id=151645, max_window_layers=shape["num_hidden_layers"], use_cache=False)


def write_folder(folder, shape, tokenizer):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config_json(shape), f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer, name), folder)


def tensor_shapes(c: dict) -> dict:
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    s = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
         "score.0.weight": (h, h), "score.0.bias": (h,), "score.2.weight": (2, h), "score.2.bias": (2,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        s.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                  p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                  p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                  p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                  p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h),
                  p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)})
    return s


def init_value(name, shape, rng_normal):
    """transformers' Qwen2 init (normal 0.02), norms near 1, small random biases so they matter;
    the head scaled so its probabilities spread over (0, 1) instead of sitting at 0.5, where a
    score is least sensitive to an error in the hidden states."""
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 1.0 + 0.1 * rng_normal(shape)
    if name.startswith("score.") and name.endswith(".weight"):
        return (1.0 if name == "score.0.weight" else 4.0) / shape[1] ** 0.5 * rng_normal(shape)
    return 0.02 * rng_normal(shape)


def make_small(folder, tokenizer):
    from safetensors.numpy import save_file
    write_folder(folder, SMALL, tokenizer)
    rng = np.random.default_rng(0)
    w = {n: init_value(n, s, lambda sh: rng.standard_normal(sh)).astype(np.float32)
         for n, s in tensor_shapes(SMALL).items()}
    save_file(w, os.path.join(folder, "model.safetensors"))
    return sum(v.size for v in w.values())


def make_big(folder, tokenizer):
    """The 7B-shaped bf16 checkpoint, made on the GPU; returns the parameter count."""
    import torch
    from safetensors.torch import save_file
    write_folder(folder, BIG, tokenizer)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {n: init_value(n, s, lambda sh: torch.randn(sh, generator=g, device="cuda",
                                                    dtype=torch.float32)).to(torch.bfloat16).cpu()
         for n, s in tensor_shapes(BIG).items()}
    save_file(w, os.path.join(folder, "model.safetensors"))
    return sum(v.numel() for v in w.values())


def load_traces(data_dir, limit):
    traces = []
    for name in ("gsm8k.json", "math.json"):
        with open(os.path.join(data_dir, name)) as f:
            traces += json.load(f)[: limit // 2]
    return [{"id": t["id"], "question": t["problem"], "steps": t["steps"]} for t in traces]


def encode(tokenizer, traces):
    """Each trace as Qwen2.5-Math-PRM reads it (the model card's chat + <extra_0> layout), rendered
    by jinja2 and transformers (which must agree) with the positions found two ways."""
    from scripts.fixtures.real_tokenizer_ids import Tok, qwen2_math_prm
    tok = Tok(tokenizer)
    return [qwen2_math_prm(tok, t) for t in traces]


# ------------------------------------------------------------------ retrace as a server

class Retrace:
    def __init__(self, binary, folder, device, dtype, out, tag, max_batch_size=64):
        self.http = free_port()
        cfg = os.path.join(out, f"retrace-{tag}.toml")
        with open(cfg, "w") as f:
            f.write(f"""[server]
grpc_addr = "127.0.0.1:{free_port()}"
http_addr = "127.0.0.1:{self.http}"
metrics_addr = "127.0.0.1:{free_port()}"
default_evaluator = "prm"

[[evaluator]]
name = "prm"
kind = "prm"
family = "qwen2-math-prm"
model = "{folder}"
device = "{device}"
dtype = "{dtype}"
max_batch_size = {max_batch_size}
prefix_cache_mb = 0
""")
        self.log = open(os.path.join(out, f"retrace-{tag}.log"), "w")
        self.proc = subprocess.Popen([binary, "serve", "--config", cfg], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.peak = Peak(self.proc.pid)

    def wait_ready(self, limit_s):
        t0 = time.time()
        while time.time() - t0 < limit_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"retrace exited with {self.proc.returncode} (see {self.log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.time() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"retrace not ready after {limit_s} s")

    def evaluate(self, trace):
        body = json.dumps({"id": trace["id"], "trace": {"question": trace["question"],
                                                         "steps": trace["steps"]}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}/v1/evaluate", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            reply = json.load(r)
        return [s.get("score", 0.0) for s in reply["steps"]]

    def scores(self, traces, concurrency=8):
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(self.evaluate, traces))

    def stop(self):
        self.peak.stop()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Peak:
    """Samples a process's memory: its GPU memory from nvidia-smi when there is one, else its RSS
    high-water mark from /proc."""

    def __init__(self, pid):
        self.pid, self.gpu_mib, self.rss_mib, self.done = pid, 0, 0, False
        self.smi = shutil.which("nvidia-smi")
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while not self.done:
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.rss_mib = max(self.rss_mib, int(line.split()[1]) // 1024)
            except OSError:
                pass
            if self.smi:
                try:
                    q = subprocess.run([self.smi, "--query-compute-apps=pid,used_memory",
                                        "--format=csv,noheader,nounits"], capture_output=True,
                                       text=True, timeout=5).stdout
                    for line in q.splitlines():
                        pid, mib = [x.strip() for x in line.split(",")]
                        if int(pid) == self.pid:
                            self.gpu_mib = max(self.gpu_mib, int(mib))
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    pass
            time.sleep(0.2)

    def stop(self):
        self.done = True


# ------------------------------------------------------------------ references

def numpy_scores(folder, encoded):
    """float64 numpy forward (scripts/reference/numpy_decoder.py) with the PRM head in float64."""
    from scripts.reference import numpy_decoder
    m = numpy_decoder.load(folder)
    w = {k: np.asarray(v, dtype=np.float64) for k, v in m.weights.items()}
    out = []
    for e in encoded:
        h = m.hidden(e["input_ids"])[e["score_positions"]]
        z = np.maximum(h @ w["score.0.weight"].T + w["score.0.bias"], 0) @ w["score.2.weight"].T
        z = z + w["score.2.bias"]
        z = z - z.max(-1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
        out.append(p[:, 1].tolist())
    return out


class TorchPrm:
    """transformers' Qwen2Model with the Qwen2.5-Math-PRM head (score.0 -> ReLU -> score.2) in torch."""

    def __init__(self, folder, dtype, attn="sdpa"):
        import torch
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
        from safetensors.torch import load_file
        from transformers import Qwen2Config, Qwen2Model
        raw = json.load(open(os.path.join(folder, "config.json")))
        cfg = Qwen2Config(**{k: v for k, v in raw.items() if k not in ("architectures",)})
        cfg._attn_implementation = attn
        w = load_file(os.path.join(folder, "model.safetensors"), device="cuda")
        with torch.device("cuda"):
            self.model = Qwen2Model(cfg).to(dtype).eval()
        self.model.load_state_dict({k[6:]: v for k, v in w.items() if k.startswith("model.")})
        self.head = {k: v.to(dtype) for k, v in w.items() if k.startswith("score.")}
        # Matmul parameters (the FLOP count's): the embedding is a lookup, not a product.
        self.params = sum(p.numel() for n, p in self.model.named_parameters()
                          if "embed_tokens" not in n) + sum(v.numel() for v in self.head.values())
        self.dtype, self.torch = dtype, torch

    def probs(self, hidden):
        t, h = self.torch, self.head
        z = t.relu(hidden @ h["score.0.weight"].T + h["score.0.bias"])
        z = z @ h["score.2.weight"].T + h["score.2.bias"]
        return t.softmax(z.float(), -1)[..., 1]

    def scores(self, encoded, batch=1):
        """Padded batches (right padding with an attention mask), as a Python reward server runs."""
        t, out = self.torch, []
        with t.inference_mode():
            for i in range(0, len(encoded), batch):
                chunk = encoded[i:i + batch]
                n = max(len(e["input_ids"]) for e in chunk)
                ids = t.full((len(chunk), n), 151643, dtype=t.long, device="cuda")
                mask = t.zeros((len(chunk), n), dtype=t.long, device="cuda")
                for r, e in enumerate(chunk):
                    ids[r, : len(e["input_ids"])] = t.tensor(e["input_ids"])
                    mask[r, : len(e["input_ids"])] = 1
                hid = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
                p = self.probs(hid)
                for r, e in enumerate(chunk):
                    out.append(p[r, e["score_positions"]].tolist())
        return out


def diff(a, b):
    d = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    counts_match = all(len(ra) == len(rb) for ra, rb in zip(a, b)) and len(a) == len(b)
    return {"max_abs": max(d) if d else None, "mean_abs": float(np.mean(d)) if d else None,
            "steps": len(d), "step_counts_match": counts_match}


# ------------------------------------------------------------------ stages

def run_exact_f32(a, ckpt, traces, encoded):
    srv = Retrace(a.retrace, ckpt["small"], a.device, "f32", a.out, "small-f32")
    try:
        ready = srv.wait_ready(120)
        got = srv.scores(traces)
    finally:
        srv.stop()
    if a.mode == "cuda":
        ref = TorchPrm(ckpt["small"], "f32", attn="eager").scores(encoded)
        ref_name = "transformers Qwen2Model f32 (eager) + head in torch f32"
    else:
        ref = numpy_scores(ckpt["small"], encoded)
        ref_name = "scripts/reference/numpy_decoder.py float64 + head in float64"
    d = diff(got, ref)
    return {"reference": ref_name, "traces": len(traces), "tolerance": 1e-4,
            "pass": d["step_counts_match"] and d["max_abs"] is not None and d["max_abs"] <= 1e-4,
            "server_ready_s": round(ready, 1), **d, "example": {"retrace": got[0], "reference": ref[0]}}


def run_exact_bf16(a, ckpt, traces, encoded, state):
    """retrace bf16 and transformers bf16 against the same weights in f32: retrace passes when its
    error is at most twice transformers' own bf16 error (and at most 0.02 on a probability)."""
    import torch
    # 32 traces: the f32 truth runs them one by one through a 30 GB model.
    traces, encoded = traces[:32], encoded[:32]
    srv = state["big_server"]
    got = srv.scores(traces)
    hf = state["hf_bf16"].scores(encoded, batch=1)
    f32 = TorchPrm(ckpt["big"], "f32", attn="sdpa")
    truth = f32.scores(encoded, batch=1)
    del f32
    torch.cuda.empty_cache()
    d_rt, d_hf, d_pair = diff(got, truth), diff(hf, truth), diff(got, hf)
    bound = max(2 * (d_hf["max_abs"] or 0), 5e-3)
    ok = d_rt["step_counts_match"] and d_rt["max_abs"] <= min(bound, 0.02)
    return {"traces": len(traces), "truth": "transformers Qwen2Model f32 of the bf16 weights + head in f32",
            "retrace_bf16_vs_f32": d_rt, "transformers_bf16_vs_f32": d_hf,
            "retrace_vs_transformers_bf16": d_pair, "tolerance": bound, "pass": ok,
            "example": {"retrace": got[0], "transformers_bf16": hf[0], "f32": truth[0]}}


def run_throughput(a, srv, encoded, traces, params, py=None):
    rows = []
    tokens = sum(len(e["input_ids"]) for e in encoded)
    sizes = [b for b in BATCH_SIZES if b <= a.max_batch]
    srv.scores(traces[: min(8, len(traces))])  # warm-up
    if py is not None:
        py.scores(encoded[:8], batch=8)
        py.torch.cuda.synchronize()
        py.torch.cuda.reset_peak_memory_stats()
    for b in sizes:
        t0 = time.time()
        srv.scores(traces, concurrency=b)
        rt = time.time() - t0
        row = {"batch": b, "tokens": tokens, "retrace_s": round(rt, 3),
               "retrace_tok_s": round(tokens / rt, 1)}
        if py is not None:
            py.torch.cuda.synchronize()
            t0 = time.time()
            py.scores(encoded, batch=b)
            py.torch.cuda.synchronize()
            pt = time.time() - t0
            row.update({"python_s": round(pt, 3), "python_tok_s": round(tokens / pt, 1)})
        if a.mode == "cuda":
            for k in ("retrace", "python"):
                if f"{k}_s" in row:
                    row[f"{k}_mfu"] = round(2 * params * tokens / row[f"{k}_s"] / H200_BF16_DENSE_FLOPS, 4)
        rows.append(row)
        print(f"[gpu-check]   {row}", flush=True)
        # What a stage that runs out of time leaves behind.
        with open(os.path.join(a.out, "throughput_rows.json"), "w") as f:
            json.dump(rows, f, indent=1)
    res = {"traces": len(traces), "tokens_per_pass": tokens, "params": params, "rows": rows,
           "retrace_client": "HTTP /v1/evaluate, one trace per request, `batch` requests in flight; "
                             "the server packs them (max_batch_size 64)"}
    if py is not None:
        res["python_server"] = ("transformers Qwen2Model bf16, sdpa, right-padded batches of `batch` "
                                "traces with an attention mask, head in bf16, in-process (no HTTP)")
        res["python_peak_mib"] = round(py.torch.cuda.max_memory_allocated() / 2**20)
    else:
        res["python_server"] = "not run: cpu mode has no torch"
    return res


def summary(out):
    lines = ["# retrace GPU check", ""]
    for name in ("checkpoints", "exact_f32", "load_7b", "exact_bf16", "throughput", "memory"):
        p = os.path.join(out, f"{name}.json")
        if not os.path.exists(p):
            lines.append(f"- {name}: not run")
            continue
        r = json.load(open(p))
        if not r.get("ok"):
            lines.append(f"- {name}: FAILED ({r.get('error')})")
            continue
        if name.startswith("exact"):
            lines.append(f"- {name}: pass={r['pass']} " + json.dumps(
                {k: v for k, v in r.items() if k not in ("example", "ok", "trace")}))
        elif name == "throughput":
            lines += ["", "| batch | retrace tok/s | python tok/s | retrace MFU | python MFU |",
                      "|---|---|---|---|---|"]
            for row in r["rows"]:
                lines.append(f"| {row['batch']} | {row['retrace_tok_s']} | {row.get('python_tok_s', '-')} "
                             f"| {row.get('retrace_mfu', '-')} | {row.get('python_mfu', '-')} |")
            lines.append("")
        else:
            lines.append(f"- {name}: " + json.dumps({k: v for k, v in r.items() if k != "ok"}))
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["cuda", "cpu"], default="cpu")
    ap.add_argument("--retrace")
    ap.add_argument("--tokenizer")
    ap.add_argument("--data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None, help="where checkpoints go (default OUT/../gpu-check-work)")
    ap.add_argument("--traces", type=int, default=None)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--summary-only", action="store_true", help="rewrite summary.md from the result files")
    a = ap.parse_args()
    if a.summary_only:
        summary(a.out)
        return 0
    a.device = "cuda" if a.mode == "cuda" else "cpu"
    os.makedirs(a.out, exist_ok=True)
    work = a.work or os.path.join(os.path.dirname(os.path.abspath(a.out)), "gpu-check-work")
    ntr = a.traces or (128 if a.mode == "cuda" else 16)
    ckpt, state = {"small": os.path.join(work, "small-f32"), "big": os.path.join(work, "prm-7b-bf16")}, {}

    def checkpoints():
        return {"small": ckpt["small"], "small_params": make_small(ckpt["small"], a.tokenizer)}

    traces = load_traces(a.data, ntr)
    encoded = encode(a.tokenizer, traces)
    if stage(a.out, "checkpoints", 60, checkpoints)["ok"] is False:
        summary(a.out)
        return 1
    stage(a.out, "exact_f32", 60, run_exact_f32, a, ckpt, traces, encoded)
    if a.mode == "cuda":
        def start_big():
            t0 = time.time()
            params = make_big(ckpt["big"], a.tokenizer)
            made = time.time() - t0
            state["big_server"] = Retrace(a.retrace, ckpt["big"], "cuda", "bf16", a.out, "7b-bf16")
            state["hf_bf16"] = TorchPrm(ckpt["big"], "bf16", attn="sdpa")
            return {"checkpoint": ckpt["big"], "params": params, "made_s": round(made, 1),
                    "server_ready_s": round(state["big_server"].wait_ready(150), 1)}
        try:
            if stage(a.out, "load_7b", 200, start_big)["ok"]:
                stage(a.out, "exact_bf16", 80, run_exact_bf16, a, ckpt, traces, encoded, state)
                stage(a.out, "throughput", 120, run_throughput, a, state["big_server"], encoded, traces,
                      state["hf_bf16"].params, state["hf_bf16"])
        finally:
            if "big_server" in state:
                srv = state["big_server"]
                srv.stop()
                json.dump({"ok": True, "retrace_gpu_peak_mib": srv.peak.gpu_mib,
                           "retrace_rss_peak_mib": srv.peak.rss_mib,
                           "python_peak_mib": json.load(open(os.path.join(a.out, "throughput.json")))
                           .get("python_peak_mib") if os.path.exists(os.path.join(a.out, "throughput.json"))
                           else None}, open(os.path.join(a.out, "memory.json"), "w"), indent=1)
    else:
        def cpu_throughput():
            srv = Retrace(a.retrace, ckpt["small"], "cpu", "f32", a.out, "small-f32-speed")
            try:
                srv.wait_ready(60)
                res = run_throughput(a, srv, encoded, traces, None)
            finally:
                srv.stop()
            json.dump({"ok": True, "retrace_rss_peak_mib": srv.peak.rss_mib,
                       "note": "cpu mode: resident memory high-water mark of retrace serve"},
                      open(os.path.join(a.out, "memory.json"), "w"), indent=1)
            return res
        stage(a.out, "throughput", 200, cpu_throughput)
    summary(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
