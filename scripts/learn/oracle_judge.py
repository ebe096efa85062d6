"""An oracle judge for measuring the learning loop: an OpenAI-compatible chat server that answers
each trace with its gold label from labelled data. It stands in for the strong judge a user
brings (a large model behind an API); it is not a judge, and figures made with it say so.

  python3 -m scripts.learn.oracle_judge --data FILE [FILE ...] --port P

It finds the trace in the judge's prompt by its question and steps (every step's text must be in
the prompt) and replies in retrace's text verdict format: `\\boxed{K}` and a category line. A
trace it cannot find gets a 404, so a measurement never runs on made-up labels. Standard
library only.
"""

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from scripts.lib.common import read_rows


def load(files):
    """Labelled rows by question: ProcessBench JSON arrays or JSONL rows."""
    by_question = {}
    for f in files:
        for r in read_rows(f):
            q = r.get("question") or r.get("problem")
            by_question.setdefault(q.strip(), []).append((r["steps"], int(r["label"]), r.get("category")))
    return by_question


def verdict(by_question, prompt):
    for q, traces in by_question.items():
        if q not in prompt:
            continue
        for steps, label, category in traces:
            if all(s.strip() in prompt for s in steps):
                if label < 0:
                    return "All paragraphs hold.\n\\boxed{-1}\nCategory: None"
                name = (category or "reasoning").capitalize()
                return f"Paragraph {label} is the first error.\n\\boxed{{{label}}}\nCategory: {name}"
    return None


def handler(by_question):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            prompt = "\n".join(m.get("content", "") for m in body.get("messages", [])
                               if isinstance(m.get("content"), str))
            content = verdict(by_question, prompt)
            if content is None:
                self.answer(404, {"error": {"message": "the oracle holds no label for this trace"}})
                return
            n = int(body.get("n", 1))
            choices = [{"index": i, "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop"} for i in range(n)]
            self.answer(200, {"id": "oracle", "object": "chat.completion", "model": "oracle",
                              "choices": choices,
                              "usage": {"prompt_tokens": 0, "completion_tokens": 0}})

        def answer(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Handler


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", a.port), handler(load(a.data)))
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
