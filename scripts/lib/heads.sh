# What the head benches share (head-bench.sh, head-kinds.sh, default-head.sh), sourced after
# common.sh and run from the repository root:
#
#   release_bin                     sets BIN: $RETRACE_BIN, or target/release/retrace built now
#   cut_data DATA OUT ARGS...       head_bench.py's cut of DATA into OUT/data (ARGS: its options)
#   zero_shot_chat_lm BASE OUT      chat-lm on BASE, its threshold chosen on OUT/data's dev
#                                   files and tested on its test files (OUT/chat-lm.log and
#                                   OUT/chat-lm/), as the head benches' contender

release_bin() {
  BIN=${RETRACE_BIN:-}
  if [ -z "$BIN" ]; then
    cargo build --release --locked --quiet
    BIN=target/release/retrace
  fi
}

cut_data() {
  local data=$1 out=$2
  shift 2
  python3 -m scripts.bench.head_bench prepare --data "$data" --out "$out/data" "$@"
}

zero_shot_chat_lm() {
  local base=$1 out=$2
  cat > "$out/chat-lm.toml" <<TOML
[[evaluator]]
name = "chat-lm"
kind = "prm"
family = "chat-lm"
model = "$base"
TOML
  "$BIN" calibrate --config "$out/chat-lm.toml" --evaluator chat-lm --per-split \
    --calibrate-on "$out"/data/dev-*.json --test-on "$out"/data/test-*.json \
    --out "$out/chat-lm" > "$out/chat-lm.log"
}
