# Sourced by the benchmark scripts that start local servers: a free port on 127.0.0.1, waiting
# for an HTTP endpoint to answer, and the servers started (PIDS) stopped when the script exits.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
wait_http() { # URL, seconds
  for _ in $(seq 1 "$2"); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 1; done
  echo "no answer from $1" >&2; return 1
}
