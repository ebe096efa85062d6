"""A fake OpenAI-compatible upstream for the server's judge evaluator, in a thread.

It answers POST /v1/chat/completions the way the judge reads replies (src/judge/output.rs,
src/judge/parse.rs): with `response_format` (the judge's default json_schema mode) a JSON object
{"analysis", "earliest_error", "error_category"}; without it, text ending in `\\boxed{i}` and a
`Category:` line. Its verdict comes from the trace itself, so tests know the answer: the first
<paragraph_i> holding a marker is the first error, and the marker names the category.
A problem containing SLOW is answered after SLOW_S seconds (for deadline tests).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MARKERS = {"WRONG": "Reasoning", "MISREAD": "Misinterpretation", "INVENTED": "Hallucination"}
SLOW_S = 3.0
_PARAGRAPH = re.compile(r"<paragraph_(\d+)>\n(.*?)\n</paragraph_\1>", re.DOTALL)


def verdict_of(prompt: str) -> tuple[int, str]:
    """The fake's verdict on a judge prompt: (first error index or -1, category name)."""
    for index, body in _PARAGRAPH.findall(prompt):
        for marker, category in MARKERS.items():
            if marker in body:
                return int(index), category
    return -1, "None"


def expected(steps: list[str]) -> tuple[int, str]:
    """What the fake will answer for these steps, as a test computes it from its own input."""
    for i, s in enumerate(steps):
        for marker, category in MARKERS.items():
            if marker in s:
                return i, category.lower()
    return -1, "none"


class FakeJudge:
    def __init__(self):
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                with judge._lock:
                    judge.requests.append({"path": self.path, "body": body, "auth": self.headers.get("authorization")})
                if self.path != "/v1/chat/completions":
                    self.send_error(404)
                    return
                prompt = "\n".join(m.get("content") or "" for m in body["messages"] if m["role"] == "user")
                if "SLOW" in prompt:
                    time.sleep(SLOW_S)
                index, category = verdict_of(prompt)
                if "response_format" in body:
                    content = json.dumps(
                        {"analysis": f"fake review: first error {index}", "earliest_error": index,
                         "error_category": category}
                    )
                else:
                    content = f"fake review.\n\\boxed{{{index}}}\nCategory: {category}"
                n = int(body.get("n") or 1)
                reply = {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "model": body.get("model", "fake"),
                    "choices": [
                        {"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}
                        for i in range(n)
                    ],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
                }
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the judge gave up on this request (a deadline test)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def prompts(self) -> list[str]:
        with self._lock:
            return ["\n".join(m.get("content") or "" for m in r["body"]["messages"]) for r in self.requests]

    def start(self) -> "FakeJudge":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
