#!/usr/bin/env python3
"""Independent float64 numpy forward pass for Llama / Qwen2 / Mistral-style decoders.

This is a *reference*, written from the Hugging Face modelling code's maths, not from the Rust code,
so it can check the Rust/candle implementation. Everything runs in float64 (weights are upcast at
load time), so it is slow and memory-hungry (8 bytes per parameter): use it for tiny random
checkpoints and small real models (SmolLM2-135M takes ~1.1 GB).

API
---
    import numpy_decoder as nd
    m = nd.load("/path/to/hf_folder")      # config.json + model.safetensors (or sharded *.index.json)
    h = m.hidden([1, 2, 3])                # np.ndarray [L, H] float64: final hidden states, after the last RMSNorm
    z = m.logits(h)                        # np.ndarray [L, V] (or [V] for a single row): h @ lm_head.T
    m.config                               # the parsed config.json (dict)
    m.weights                              # dict name -> float64 array (HF names), e.g. for custom heads
                                           # such as score.0 / score.2 / v_head.summary

Supported
- RMSNorm (x * rsqrt(mean(x^2) + eps) * w), HF `rotate_half` RoPE (cos/sin tables in float64),
  `rope_scaling` of type llama3 (Llama 3.1) and default/None; other scaling types raise.
- GQA (K/V heads repeated), `head_dim` from config when present, else hidden/heads.
- Optional biases on q/k/v/o and MLP projections: used when the tensors exist (Qwen2 has q/k/v bias).
- Optional per-head q_norm / k_norm RMSNorm (Qwen3-style) when those tensors exist.
- Causal softmax attention with scale 1/sqrt(head_dim); SwiGLU MLP (silu(gate) * up -> down).
- Sliding window: a query at position i sees keys j with 0 <= i - j < window.
  * mistral / llama: window = config["sliding_window"] when it is present and not null.
  * qwen2: only when use_sliding_window is true, and then (as in HF) only for layers
    >= max_window_layers, or per config["layer_types"] == "sliding_attention" when that is given.
- lm_head: `lm_head.weight`, or embed_tokens when tie_word_embeddings is true or lm_head is missing.

Not supported: batching/padding (one sequence per call), KV cache, partial rotary, other rope types.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

__all__ = ["load", "Model", "read_safetensors"]

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Reads a .safetensors file into float64 arrays (handles BF16, which numpy lacks)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        base = 8 + n
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        buf = raw[base + start: base + end]
        dt, shape = info["dtype"], info["shape"]
        if dt == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dt in _DTYPES:
            a = np.frombuffer(buf, dtype=np.dtype(_DTYPES[dt]).newbyteorder("<"))
        else:
            raise ValueError(f"{name}: unsupported dtype {dt}")
        out[name] = a.reshape(shape).astype(np.float64)
    return out


def _load_weights(folder: str) -> dict[str, np.ndarray]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    w = {}
    for fn in files:
        w.update(read_safetensors(os.path.join(folder, fn)))
    return w


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _inv_freq(cfg: dict, head_dim: int) -> np.ndarray:
    theta = float(cfg.get("rope_theta", 10000.0))
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise NotImplementedError(f"rope_scaling type {kind!r}")
    factor = float(rs["factor"])
    low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_ctx = float(rs["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2.0 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


class Model:
    """A loaded decoder. Build it with `load(folder)`."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray]):
        self.config = config
        self.weights = weights
        c = config
        self.n_layers = int(c["num_hidden_layers"])
        self.n_heads = int(c["num_attention_heads"])
        self.n_kv = int(c.get("num_key_value_heads") or self.n_heads)
        self.hidden_size = int(c["hidden_size"])
        self.head_dim = int(c.get("head_dim") or self.hidden_size // self.n_heads)
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.inv_freq = _inv_freq(c, self.head_dim)
        self.windows = [self._window(i) for i in range(self.n_layers)]
        tie = c.get("tie_word_embeddings", False)
        if tie or "lm_head.weight" not in weights:
            self.lm_head = weights["model.embed_tokens.weight"]
        else:
            self.lm_head = weights["lm_head.weight"]

    def _window(self, layer: int):
        c = self.config
        sw = c.get("sliding_window")
        if sw is None:
            return None
        if c.get("model_type") in ("qwen2", "qwen3"):
            if not c.get("use_sliding_window", False):
                return None
            types = c.get("layer_types")
            if types is not None:
                return int(sw) if types[layer] == "sliding_attention" else None
            return int(sw) if layer >= int(c.get("max_window_layers", 0)) else None
        return int(sw)

    def _w(self, name: str):
        return self.weights.get(name)

    def _linear(self, x: np.ndarray, prefix: str) -> np.ndarray:
        y = x @ self.weights[prefix + ".weight"].T
        b = self._w(prefix + ".bias")
        return y if b is None else y + b

    def hidden(self, ids) -> np.ndarray:
        """Final hidden states [L, H] (float64) after the last RMSNorm, for one sequence of ids."""
        ids = np.asarray(ids, dtype=np.int64)
        L = ids.shape[0]
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        x = self.weights["model.embed_tokens.weight"][ids]
        pos = np.arange(L, dtype=np.float64)
        freqs = np.outer(pos, self.inv_freq)
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb)[None], np.sin(emb)[None]  # [1, L, hd]
        i_idx = np.arange(L)[:, None]
        j_idx = np.arange(L)[None, :]
        for layer in range(self.n_layers):
            p = f"model.layers.{layer}."
            h = _rms(x, self.weights[p + "input_layernorm.weight"], self.eps)
            q = self._linear(h, p + "self_attn.q_proj").reshape(L, nh, hd).transpose(1, 0, 2)
            k = self._linear(h, p + "self_attn.k_proj").reshape(L, nkv, hd).transpose(1, 0, 2)
            v = self._linear(h, p + "self_attn.v_proj").reshape(L, nkv, hd).transpose(1, 0, 2)
            qn, kn = self._w(p + "self_attn.q_norm.weight"), self._w(p + "self_attn.k_norm.weight")
            if qn is not None:
                q = _rms(q, qn, self.eps)
            if kn is not None:
                k = _rms(k, kn, self.eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            rep = nh // nkv
            k = np.repeat(k, rep, axis=0)
            v = np.repeat(v, rep, axis=0)
            scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd)  # [nh, L, L]
            allowed = j_idx <= i_idx
            win = self.windows[layer]
            if win is not None:
                allowed = allowed & (i_idx - j_idx < win)
            scores = np.where(allowed[None], scores, -np.inf)
            scores = scores - scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = (probs @ v).transpose(1, 0, 2).reshape(L, nh * hd)
            x = x + self._linear(attn, p + "self_attn.o_proj")
            h = _rms(x, self.weights[p + "post_attention_layernorm.weight"], self.eps)
            g = self._linear(h, p + "mlp.gate_proj")
            u = self._linear(h, p + "mlp.up_proj")
            x = x + self._linear(_silu(g) * u, p + "mlp.down_proj")
        return _rms(x, self.weights["model.norm.weight"], self.eps)

    def logits(self, hidden_rows: np.ndarray) -> np.ndarray:
        """LM-head logits for hidden rows ([H] -> [V], [N, H] -> [N, V])."""
        return np.asarray(hidden_rows, dtype=np.float64) @ self.lm_head.T


def load(folder: str) -> Model:
    """Loads config.json and the safetensors weights (upcast to float64) of an HF folder."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    return Model(cfg, _load_weights(folder))


if __name__ == "__main__":  # quick check: scripts/reference/numpy_decoder.py FOLDER "text"
    import sys

    from tokenizers import Tokenizer

    folder, text = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "The capital of France is"
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    m = load(folder)
    z = m.logits(m.hidden(ids)[-1])
    pr = np.exp(z - z.max())
    pr /= pr.sum()
    for i in np.argsort(-z)[:5]:
        print(f"{int(i):6d} {tok.decode([int(i)])!r:20} p={pr[i]:.4f} logit={z[i]:.4f}")
