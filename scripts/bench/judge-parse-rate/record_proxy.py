"""A recording proxy between retrace and llama-server for scripts/bench/judge-parse-rate.sh.

Forwards every POST to the upstream unchanged and appends one JSON line per reply choice to the
log: the output mode the request asked for (read from its body), whether it was the first turn
or a repair, the trace's paragraph count (from the prompt's tags), the reply text and why it
stopped. These lines become the real-reply corpus under tests/fixtures/.

Usage: record_proxy.py LISTEN_PORT UPSTREAM_BASE LOG_PATH
"""

import json
import re
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, UPSTREAM, LOG = int(sys.argv[1]), sys.argv[2].rstrip("/"), sys.argv[3]
LOCK = threading.Lock()


def mode_of(body):
    if "response_format" in body:
        return "json_schema"
    if "grammar" in body:
        return "grammar"
    return "text"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {"content-type": "application/json"}
        if self.headers.get("authorization"):
            headers["authorization"] = self.headers["authorization"]
        req = urllib.request.Request(UPSTREAM + self.path, data=raw, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=900) as r:
                status, out = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, out = e.code, e.read()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
        if status != 200:
            return
        body = json.loads(raw)
        prompt = body["messages"][0]["content"]
        n_steps = len(set(re.findall(r"</paragraph_(\d+)>", prompt)))
        reply = json.loads(out)
        with LOCK, open(LOG, "a") as f:
            for c in reply.get("choices", []):
                f.write(json.dumps({
                    "mode": mode_of(body),
                    "turn": "reply" if len(body["messages"]) == 1 else "repair",
                    "n_steps": n_steps,
                    "reply": c["message"].get("content") or "",
                    "finish_reason": c.get("finish_reason"),
                }) + "\n")


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
