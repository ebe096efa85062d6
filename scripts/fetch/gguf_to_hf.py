#!/usr/bin/env python3
"""Convert a llama.cpp GGUF (Llama-architecture decoder, e.g. SmolLM2) into a Hugging Face folder.

Usage: gguf_to_hf.py GGUF OUTDIR

Writes OUTDIR/{model.safetensors (float32), config.json, tokenizer.json, tokenizer_config.json,
generation_config.json}. Needs only numpy, gguf, safetensors and tokenizers (no torch).

Notes
- Tensors are dequantized with gguf.quants.dequantize; GGUF stores shapes innermost-first, so the
  numpy array already has the HF (out_features, in_features) layout.
- For GGUF architecture `llama`, llama.cpp's converter permuted the rows of Q and K per head (from
  HF's rotate_half layout to interleaved pairs); this script undoes it. Other architectures (qwen2)
  are not permuted by llama.cpp and are copied as they are.
- The tokenizer is rebuilt from tokenizer.ggml.* metadata (GPT-2-style byte-level BPE). The
  pre-tokenizer follows llama.cpp's `tokenizer.ggml.pre`: `smollm` = Digits(individual) + ByteLevel
  GPT-2 regex; `gpt2`/`default` = ByteLevel only. Other pre-tokenizers are rejected.
"""

from __future__ import annotations

import json
import os
import sys

import gguf
import numpy as np
from gguf import GGUFReader
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hf_name(name: str) -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_MAP:
        return f"model.layers.{parts[1]}.{LAYER_MAP[parts[2]]}.{parts[3]}"
    raise ValueError(f"unmapped GGUF tensor {name!r}")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf's `permute` (rows grouped per head)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequant(t) -> np.ndarray:
    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF shape is innermost-first
    a = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.ascontiguousarray(a.reshape(shape).astype(np.float32))


def build_tokenizer(reader: GGUFReader) -> tuple[Tokenizer, list[str], list[int]]:
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise SystemExit(f"only BPE (tokenizer.ggml.model = gpt2) is supported, got {model!r}")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    types = [int(x) for x in field(reader, "tokenizer.ggml.token_type")]
    merges = [tuple(m.split(" ")) for m in field(reader, "tokenizer.ggml.merges")]
    assert all(len(m) == 2 for m in merges), "merge with != 1 space"
    vocab = {tok: i for i, tok in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate token strings"

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("gpt2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        raise SystemExit(f"unsupported tokenizer.ggml.pre {pre!r}")
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    # Offsets only; adds no token (SmolLM2 does not add BOS: tokenizer.ggml.add_bos_token = false).
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    if field(reader, "tokenizer.ggml.add_bos_token", False):
        print("warning: GGUF says add_bos_token = true; tokenizer.json does not add it", file=sys.stderr)

    special = [i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    user = [i for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    added = [AddedToken(tokens[i], special=True, normalized=False) for i in special]
    added += [AddedToken(tokens[i], special=False, normalized=False) for i in user]
    tok.add_tokens(added)
    for i in special + user:
        assert tok.token_to_id(tokens[i]) == i, (i, tokens[i])
    return tok, tokens, special


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    reader = GGUFReader(src)
    arch = field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise SystemExit(f"unsupported architecture {arch!r}")

    def meta(key, default=None):
        return field(reader, f"{arch}.{key}", default)

    n_head = int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_head))
    hidden = int(meta("embedding_length"))
    n_layer = int(meta("block_count"))

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = dequant(t)
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            w = unpermute(w, n_head)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            w = unpermute(w, n_kv)
        tensors[name] = np.ascontiguousarray(w)
    tied = "lm_head.weight" not in tensors

    tok, tokens, special = build_tokenizer(reader)
    vocab_size = int(meta("vocab_size", len(tokens)))
    assert tensors["model.embed_tokens.weight"].shape == (vocab_size, hidden)
    head_dim = hidden // n_head
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise SystemExit(f"partial rotary ({rope_dim} of {head_dim}) not supported")

    def tok_id(key):
        v = field(reader, f"tokenizer.ggml.{key}")
        return None if v is None else int(v)

    bos, eos = tok_id("bos_token_id"), tok_id("eos_token_id")
    pad, unk = tok_id("padding_token_id"), tok_id("unknown_token_id")
    eps = float(np.float32(meta("attention.layer_norm_rms_epsilon")))
    eps = float(str(np.float32(eps)))  # shortest float32 repr, e.g. 1e-05
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else
                          "Qwen2ForCausalLM" if arch == "qwen2" else "MistralForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(meta("context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "attention_bias": any(k.endswith("q_proj.bias") for k in tensors),
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "qwen2":
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": n_layer})

    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}, f, indent=2)
        f.write("\n")
    tok.save(os.path.join(out, "tokenizer.json"))

    def name_of(i):
        return None if i is None else tokens[i]

    tok_cfg = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_prefix_space": False,
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "bos_token": name_of(bos),
        "eos_token": name_of(eos),
        "pad_token": name_of(pad),
        "unk_token": name_of(unk),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True} for i in special},
        "chat_template": field(reader, "tokenizer.chat_template"),
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {out}: {len(tensors)} tensors, arch {arch}, vocab {vocab_size}, tied {tied}")


if __name__ == "__main__":
    main()
