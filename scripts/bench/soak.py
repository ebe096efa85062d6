"""The soak: three `retrace serve` replicas on SmolLM2-135M f32 (`chat-lm`), beside a cascade
over it and a fake judge, called through the Python client's address list (its round-robin and
retries) and over HTTP by a mix of callers (Evaluate, a cascade's Evaluate, Rank,
EvaluateStream, /get_reward, /slime/reward) at 1.5x the replicas' measured capacity, with
deadlines, while faults run on a schedule: a replica SIGKILLed mid-request and started again, a
rolling restart (SIGTERM each in turn, wait for SERVING, next), the judge answering 500, hanging
past its timeout and answering garbage, a client cutting its stream, a burst of bad input (the
fuzz corpus) and of oversize traces.

It checks what callers and operators need: every answer the caller was told succeeded is right
(each PRM verdict against the same trace scored once on a quiet replica), every call ends in OK
or an expected status, goodput at least 80% of the live replicas' capacity, each replica's RSS,
file descriptors and threads flat over the run's second half (within 5%, after its last
restart), health Check p99 at most 50 ms while the model saturates the cores, and every SIGTERM
drained within shutdown_grace_s. It prints one table and writes the timeline (CSV), the RSS plot
(SVG) and summary.json to --out, and exits 1 when a target is missed.

  python3 -m scripts.bench.soak [--minutes 30] [--out runs/soak] [--binary target/release/retrace]

CI runs the short form, `--minutes 3 --floors`: the same checks, but the two a busy machine can
miss without a fault of the server's (goodput, and the resources' trend over two minutes) are
held to floors under their targets (60% and 10%), as the overload tests hold theirs; the table
shows both.

Needs the Python client in the venv (scripts/check/test-python.sh installs it) and SmolLM2 f32
(scripts/fetch-smollm2.sh --f32).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from retrace_client import Client, RetraceError
from scripts.lib.common import CACHE, ROOT, free_port, retrace_bin

DEADLINE_S = 5.0
GRACE_S = 10
# The statuses a call may end with besides OK: shed at admission, past its deadline, a replica
# down with no retry left; bad input only from the bad-input burst.
EXPECTED = {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE"}


class Wrong(Exception):
    """An answer told OK that is not the reference's: what was got, and what was wanted."""


class HttpFailure(Exception):
    """An HTTP call that ended without an answer: its status in the status table's names."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


class Judge(ThreadingHTTPServer):
    """An OpenAI-compatible judge whose mode the schedule sets: ok, 500, hang, garbage."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), JudgeHandler)
        self.mode = "ok"
        self.daemon_threads = True


class JudgeHandler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def handle_one_request(self):
        # The server gave up on a hanging answer: that is the fault, not the fake's error.
        try:
            super().handle_one_request()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        mode = self.server.mode
        if mode == "hang":
            time.sleep(8)
        if mode == "500":
            return self.reply(500, b'{"error": {"message": "soak fault"}}')
        if mode == "garbage":
            return self.reply(200, b"<html>not json</html>")
        content = "All paragraphs hold.\n\\boxed{-1}\nCategory: None"
        body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": "stop"}], "usage": {"completion_tokens": 9}}
        self.reply(200, json.dumps(body).encode())

    def reply(self, code, body):
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Replica:
    """One `retrace serve` child on its own ports; started again on the same ones."""

    def __init__(self, k, binary, config, out):
        self.k, self.binary, self.config, self.out = k, binary, config, out
        self.grpc, self.http, self.metrics = free_port(), free_port(), free_port()
        self.proc = None
        self.started = None
        self.down = []  # (from, to) monotonic windows it was not serving

    @property
    def address(self):
        return f"127.0.0.1:{self.grpc}"

    def start(self):
        # The child holds its own copy of the log's descriptor; this one closes at once.
        with open(self.out / f"replica-{self.k}.log", "a") as log:
            self.proc = subprocess.Popen(
                [self.binary, "serve", "--config", str(self.config), "--grpc-addr", self.address,
                 "--http-addr", f"127.0.0.1:{self.http}",
                 "--metrics-addr", f"127.0.0.1:{self.metrics}"],
                stdout=log, stderr=log, env={**os.environ, "RETRACE_LOG": "warn"})
        self.started = time.monotonic()

    def wait_serving(self, within=120.0):
        stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(self.address))
        end = time.monotonic() + within
        while time.monotonic() < end:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if self.proc.poll() is not None:
                sys.exit(f"replica {self.k} exited: see {self.out}/replica-{self.k}.log")
            time.sleep(0.2)
        sys.exit(f"replica {self.k} never became SERVING")

    def stop(self, sig):
        """Signals it; returns how long it took to exit."""
        began = time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(timeout=GRACE_S + 30)
        return time.monotonic() - began


def config(model, judge_port, grace_s):
    """Each replica's config: SmolLM2 as `chat-lm`, a judge on the fake, a cascade over both, and
    the reward routes scoring with the PRM by its trace score."""
    return f"""[server]
shutdown_grace_s = {grace_s}
max_trace_bytes = 8192

[reward]
evaluator = "smollm2"
reward_key = "score"
on_timeout = "empty_reward"
timeout_s = {DEADLINE_S}

[[evaluator]]
name = "smollm2"
kind = "prm"
family = "chat-lm"
model = {json.dumps(str(model))}
# A small prefix cache: memory held on purpose up to its budget fills within the run's first
# minutes, so the leak check sees what grows past it.
prefix_cache_mb = 32

[[evaluator]]
name = "judge"
kind = "judge"
base_url = "http://127.0.0.1:{judge_port}/v1"
model = "fake"
output = "text"
timeout_s = 2
retries = 1
breaker_failures = 5
breaker_cooldown_s = 5

[[evaluator]]
name = "cascade"
kind = "cascade"
prm = "smollm2"
judge = "judge"
escalate_margin = 0.2
"""


def traces(path):
    """The pool: the committed ProcessBench gsm8k traces of up to 8 steps."""
    rows = json.loads(Path(path).read_text())
    return [{"question": r["problem"], "steps": r["steps"]} for r in rows if len(r["steps"]) <= 8]


def reference(client, pool):
    """Each trace scored once, one at a time, on a quiet server: what every later answer must
    be; as steps, and as the text the reward routes send (which the server segments)."""
    steps = [client.evaluate(t["question"], t["steps"], evaluator="smollm2", timeout=60)
             for t in pool]
    text = [client.evaluate(t["question"], text="\n\n".join(t["steps"]), evaluator="smollm2",
                            timeout=60) for t in pool]
    return steps, text


def capacity(client, pool, seconds):
    """Traces a second the replicas sustain together: a closed loop of six callers."""
    end = time.monotonic() + seconds
    done = [0]
    lock = threading.Lock()

    def caller(k):
        i = k
        while time.monotonic() < end:
            t = pool[i % len(pool)]
            client.evaluate(t["question"], t["steps"], evaluator="smollm2", timeout=60)
            with lock:
                done[0] += 1
            i += 6

    began = time.monotonic()
    with ThreadPoolExecutor(6) as ex:
        list(ex.map(caller, range(6)))
    return done[0] / (time.monotonic() - began)


def same(verdict, ref):
    """An answer is right when it is the reference's verdict: the same first error (unless a
    step sits within float rounding of the threshold) and scores within 1e-3 (a prefix-cache hit
    sums in another order)."""
    scores = [s.score for s in verdict.steps]
    want = [s.score for s in ref.steps]
    if len(scores) != len(want) or max(abs(x - y) for x, y in zip(scores, want)) > 1e-3:
        return False
    near = any(abs(s - ref.threshold) < 1e-3 for s in want)
    return near or verdict.first_error_index == ref.first_error_index


def chatml(question):
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def proc_stats(pid):
    """RSS (KiB), open file descriptors and threads of a live process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return parse_status(status, fds)


def parse_status(status, fds):
    """RSS (KiB), fds and threads from /proc/PID/status; None for a process that is exiting:
    between `poll()` and the read a killed replica can be a zombie, whose status has no VmRSS."""
    field = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in field or "Threads" not in field:
        return None
    return int(field["VmRSS"].split()[0]), fds, int(field["Threads"].split()[0])


class Run:
    """The load, the faults and the watchers of one soak."""

    def __init__(self, a, replicas, client, pool, reference, judge, capacity, deadline, grace):
        self.a, self.replicas, self.client, self.pool = a, replicas, client, pool
        (self.ref, self.ref_text), self.judge, self.capacity = reference, judge, capacity
        self.deadline, self.grace = deadline, grace
        self.duration = a.minutes * 60
        self.calls = []  # (kind, start, end, status, traces_ok, wrong)
        self.samples = []  # (t, replica, rss_kib, fds, threads)
        self.health = []  # (t, replica, ms or None)
        self.events = []  # (t, what)
        self.drains = []
        self.bad_input = []  # statuses of the bad-input burst
        self.wrong = []  # (kind, what was got, what was wanted), the first few
        self.lock = threading.Lock()
        self.t0 = None
        self.done = threading.Event()
        # Traces whose steps hold no blank line, so that their text is one paragraph a step.
        self.plain = [i for i, t in enumerate(pool) if all("\n\n" not in s for s in t["steps"])]

    def now(self):
        return time.monotonic() - self.t0

    def event(self, what):
        with self.lock:
            self.events.append((round(self.now(), 1), what))
        print(f"[{self.now():7.1f} s] {what}", flush=True)

    def record(self, kind, start, status, ok=0, wrong=0):
        with self.lock:
            self.calls.append((kind, start, self.now(), status, ok, wrong))

    # -- the callers -------------------------------------------------------------------------

    def call(self, kind):
        start = self.now()
        try:
            if kind == "stream":
                # A stream's items end on their own: each is counted as its own call.
                for status, ok, wrong in self.call_stream():
                    self.record(kind, start, status, ok, wrong)
                return
            ok, wrong = getattr(self, f"call_{kind}")()
            self.record(kind, start, "OK", ok, wrong)
        except Wrong as w:
            with self.lock:
                if len(self.wrong) < 20:
                    self.wrong.append((kind, *w.args))
            self.record(kind, start, "OK", 0, 1)
        except RetraceError as e:
            self.record(kind, start, e.code)
        except HttpFailure as e:
            self.record(kind, start, e.status)

    def pick(self, plain=False):
        return random.choice(self.plain) if plain else random.randrange(len(self.pool))

    def call_evaluate(self):
        i = self.pick()
        t = self.pool[i]
        v = self.client.evaluate(t["question"], t["steps"], evaluator="smollm2")
        return self.judged(i, v)

    def judged(self, i, v):
        """One PRM verdict against the reference: (1, 0), or Wrong."""
        if not same(v, self.ref[i]):
            got = (v.first_error_index, [round(s.score, 5) for s in v.steps])
            want = (self.ref[i].first_error_index, [round(s.score, 5) for s in self.ref[i].steps])
            raise Wrong(f"trace {i}: {got}", want)
        return 1, 0

    def call_cascade(self):
        i = self.pick()
        t = self.pool[i]
        v = self.client.evaluate(t["question"], t["steps"], evaluator="cascade")
        # Escalated: the fake judge's verdict (every step holds); else the PRM's, on its path
        # or kept when the judge failed.
        if v.path == "escalated" and v.first_error_index != -1:
            raise Wrong(f"trace {i} escalated: {v.first_error_index}", "-1, the fake judge's")
        return (1, 0) if v.path == "escalated" else self.judged(i, v)

    def call_rank(self):
        i = random.choice([k for k in range(len(self.pool)) if len(self.pool[k]["steps"]) >= 3])
        t, ref = self.pool[i], self.ref[i]
        cut = [t["steps"], t["steps"][:-1], t["steps"][:-2], t["steps"]]
        ranking = self.client.rank(t["question"], cut, evaluator="smollm2")
        for c in ranking.ranked:
            n = len(cut[c.index])
            scores = [s.score for s in c.verdict.steps]
            want = [s.score for s in ref.steps][:n]
            # A prefix's step scores are the whole trace's first ones (each step reads only
            # what comes before it).
            if len(scores) != n or max(abs(x - y) for x, y in zip(scores, want)) > 1e-3:
                raise Wrong(f"trace {i} cut to {n} steps: {scores}", want)
        return len(cut), 0

    def call_stream(self):
        """Four traces on one stream: each item's (status, ok, wrong). An item refused or late
        does not undo the others' answers, which are checked like any other."""
        picks = [self.pick() for _ in range(4)]
        items = [dict(self.pool[i], evaluator="smollm2") for i in picks]
        results = self.client.evaluate_many(items, max_in_flight=4)
        outcomes = []
        for v, i in zip(results, picks):
            if isinstance(v, RetraceError):
                outcomes.append((v.code, 0, 0))
                continue
            try:
                outcomes.append(("OK", *self.judged(i, v)))
            except Wrong as w:
                with self.lock:
                    if len(self.wrong) < 20:
                        self.wrong.append(("stream", *w.args))
                outcomes.append(("OK", 0, 1))
        return outcomes

    def post(self, path, body):
        """POSTs to the replicas in turn (a router's retry): a refused connection, 503 or 429
        moves on to the next after its Retry-After, within the deadline."""
        end = time.monotonic() + self.deadline
        k = random.randrange(3)
        last = "UNAVAILABLE"
        while time.monotonic() < end:
            r = self.replicas[k % 3]
            req = urllib.request.Request(
                f"http://127.0.0.1:{r.http}{path}", data=json.dumps(body).encode(),
                headers={"content-type": "application/json",
                         "x-request-timeout": f"{max(0.1, end - time.monotonic()):.2f}"})
            try:
                with urllib.request.urlopen(req, timeout=self.deadline + 1) as reply:
                    return json.loads(reply.read())
            except urllib.error.HTTPError as e:
                last = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}.get(
                    e.code, f"HTTP {e.code}")
                if e.code not in (429, 503):
                    raise HttpFailure(last)
                wait = float(e.headers.get("retry-after", "1"))
                if time.monotonic() + wait > end:
                    break
                time.sleep(wait)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                last = "UNAVAILABLE"
                time.sleep(0.1)
            k += 1
        raise HttpFailure(last)

    def call_get_reward(self):
        picks = [self.pick(plain=True) for _ in range(2)]
        prompts = [chatml(self.pool[i]["question"]) for i in picks]
        queries = [p + "\n\n".join(self.pool[i]["steps"]) + "<|im_end|>"
                   for p, i in zip(prompts, picks)]
        got = self.post("/get_reward", {"query": queries, "prompts": prompts})
        if any(s != "ok" for s in got["status"]):
            raise HttpFailure("DEADLINE_EXCEEDED" if "timed_out" in got["status"] else "stand-in")
        for r, i in zip(got["rewards"], picks):
            if abs(r - self.ref_text[i].trace_score) > 1e-3:
                raise Wrong(f"trace {i} reward {r}", self.ref_text[i].trace_score)
        return len(picks), 0

    def call_slime(self):
        i = self.pick(plain=True)
        t = self.pool[i]
        got = self.post("/slime/reward", {"prompt": chatml(t["question"]),
                                          "response": "\n\n".join(t["steps"])})
        if got["status"] != "ok":
            raise HttpFailure("DEADLINE_EXCEEDED" if got["status"] == "timed_out" else "stand-in")
        if abs(got["score"] - self.ref_text[i].trace_score) > 1e-3:
            raise Wrong(f"trace {i} score {got['score']}", self.ref_text[i].trace_score)
        return 1, 0

    # -- the run -----------------------------------------------------------------------------

    # (caller, weight, traces a call): the offered rate counts traces.
    MIX = [("evaluate", 40, 1), ("cascade", 10, 1), ("rank", 10, 4), ("stream", 10, 4),
           ("get_reward", 15, 2), ("slime", 15, 1)]

    def go(self):
        self.t0 = time.monotonic()
        watchers = [threading.Thread(target=f, daemon=True) for f in (self.sample, self.check)]
        for w in watchers:
            w.start()
        faults = threading.Thread(target=self.faults, daemon=True)
        faults.start()
        kinds = [k for k, w, _ in self.MIX for _ in range(w)]
        per_task = sum(w * n for _, w, n in self.MIX) / sum(w for _, w, _ in self.MIX)
        rate = 1.5 * self.capacity / per_task
        pending = threading.Semaphore(256)
        with ThreadPoolExecutor(64) as ex:
            next_at = time.monotonic()
            while self.now() < self.duration:
                next_at += random.expovariate(rate)
                time.sleep(max(0.0, next_at - time.monotonic()))
                if not pending.acquire(blocking=False):
                    self.record("overflow", self.now(), "CLIENT_OVERFLOW")
                    continue
                fut = ex.submit(self.call, random.choice(kinds))
                fut.add_done_callback(lambda _: pending.release())
        faults.join()
        self.done.set()
        for w in watchers:
            w.join()

    def sample(self):
        while not self.done.is_set():
            for r in self.replicas:
                stats = proc_stats(r.proc.pid) if r.proc.poll() is None else None
                if stats:
                    with self.lock:
                        self.samples.append((round(self.now(), 1), r.k, *stats))
            self.done.wait(2.0)

    def check(self):
        stubs = [health_pb2_grpc.HealthStub(grpc.insecure_channel(r.address)) for r in self.replicas]
        while not self.done.is_set():
            for r, stub in zip(self.replicas, stubs):
                began = time.monotonic()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    ms = (time.monotonic() - began) * 1e3
                except grpc.RpcError:
                    ms = None
                with self.lock:
                    self.health.append((self.now(), r.k, ms))
            self.done.wait(0.25)

    def at(self, share):
        time.sleep(max(0.0, share * self.duration - self.now()))

    def faults(self):
        """The restarts first, so that what follows them (the judge's faults, a cut stream, bad
        input) runs inside the window where each replica's memory must stay flat."""
        d = self.duration
        self.at(0.08)
        self.restart(self.replicas[0], signal.SIGKILL)
        self.at(0.15)
        for r in self.replicas:
            self.restart(r, signal.SIGTERM)
        self.event("rolling restart done")
        self.at(0.25)
        self.event("the leak window opens")
        for share, mode, length in [(0.3, "500", 0.05), (0.37, "hang", 0.05), (0.44, "garbage", 0.04)]:
            self.at(share)
            self.judge.mode = mode
            self.event(f"judge answers {mode}")
            time.sleep(length * d)
            self.judge.mode = "ok"
            self.event("judge answers again")
        self.at(0.55)
        self.cut_stream()
        self.bad_burst()

    def restart(self, r, sig):
        name = "SIGKILL" if sig == signal.SIGKILL else "SIGTERM"
        down = time.monotonic()
        took = r.stop(sig)
        if sig == signal.SIGTERM:
            self.drains.append(took)
        self.event(f"replica {r.k} {name}: exited in {took:.2f} s")
        r.start()
        r.wait_serving()
        r.down.append((down - self.t0, time.monotonic() - self.t0))
        self.event(f"replica {r.k} serving again")

    def cut_stream(self):
        """A client that sends a stream's first items and hangs up after one answer."""
        channel = grpc.insecure_channel(self.replicas[1].address)
        stream = channel.stream_stream("/retrace.v1.Evaluator/EvaluateStream",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=lambda b: b)
        from retrace_client._proto import pb
        items = [pb.EvaluateRequest(id=str(i), evaluator="smollm2",
                                    trace=pb.Trace(question=self.pool[i]["question"],
                                                   steps=self.pool[i]["steps"]))
                 for i in range(8)]
        call = stream(iter(items), timeout=30)
        next(call)
        call.cancel()
        channel.close()
        self.event("a client cut its stream after one answer")

    def bad_burst(self):
        """The fuzz corpus's request bodies as raw Evaluate calls, and oversize traces."""
        corpus = sorted((ROOT / "fuzz" / "corpus" / "request").iterdir())[:200]
        channel = grpc.insecure_channel(self.replicas[2].address)
        raw = channel.unary_unary("/retrace.v1.Evaluator/Evaluate",
                                  request_serializer=None, response_deserializer=None)
        for f in corpus:
            try:
                raw(f.read_bytes(), timeout=self.deadline)
                self.bad_input.append("OK")
            except grpc.RpcError as e:
                self.bad_input.append(e.code().name)
        huge = ["x" * 4000] * 4
        for _ in range(20):
            try:
                self.client.evaluate("q", huge, evaluator="smollm2")
                self.bad_input.append("OK")
            except RetraceError as e:
                self.bad_input.append(e.code)
        channel.close()
        self.event(f"bad input: {len(corpus)} fuzz bodies and 20 oversize traces")

def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def flat(points, share):
    """Whether a resource stayed flat over `points` (time, value): the least-squares line's rise
    over the window, as a share of the mean, at most `share` (a count may also rise by 2). A
    slope, not first against last: RSS swings with each batch's buffers, and a leak is a trend.
    Too few points to tell is a failure, not a pass."""
    if len(points) < 8:
        return False, float("nan")
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    slope = sum((t - mt) * (v - mv) for t, v in points) / sum((t - mt) ** 2 for t, _ in points)
    rise = slope * (points[-1][0] - points[0][0])
    return rise <= mv * share + 2, rise / mv


def summarize(run):
    """What the run measured, and each target met or not."""
    calls = [c for c in run.calls if c[0] != "overflow"]
    by_status, by_kind = {}, {}
    for c in run.calls:
        by_status[c[3]] = by_status.get(c[3], 0) + 1
        kind = by_kind.setdefault(c[0], {})
        kind[c[3]] = kind.get(c[3], 0) + 1
    unexpected = [c for c in calls if c[3] != "OK" and c[3] not in EXPECTED]
    wrong = sum(c[5] for c in calls)
    down = sum(t1 - t0 for r in run.replicas for t0, t1 in r.down)
    live = 1 - down / (3 * run.duration)
    goodput = sum(c[4] for c in calls if c[3] == "OK") / run.duration
    window = next(t for t, what in run.events if what == "the leak window opens")
    # The bounds held: the targets, or with --floors the floors under the two timed ones.
    share, trend = (0.6, 0.10) if run.a.floors else (0.8, 0.05)
    leaks = {}
    for r in run.replicas:
        rows = [s for s in run.samples if s[1] == r.k and s[0] >= window + 10]
        leaks[r.k] = {name: flat([(s[0], s[col]) for s in rows], trend)
                      for name, col in (("rss", 2), ("fds", 3), ("threads", 4))}
    def is_down(k, t):
        return any(t0 - 1 <= t <= t1 + 1 for t0, t1 in run.replicas[k].down)
    checks = [(t, k, ms) for t, k, ms in run.health if not is_down(k, t)]
    health_ms = [ms for _, _, ms in checks if ms is not None]
    health_failed = sum(1 for _, _, ms in checks if ms is None)
    bad = {s: run.bad_input.count(s) for s in set(run.bad_input)}
    targets = [
        {"name": "answers told OK that were wrong", "value": wrong, "target": "0", "met": wrong == 0},
        {"name": "calls ended otherwise than OK or an expected status", "value": len(unexpected),
         "target": "0", "met": not unexpected},
        {"name": "goodput, traces/s (share of live capacity)",
         "value": f"{goodput:.2f} ({goodput / (run.capacity * live):.0%})",
         "target": ">= 80%" + (" (floor 60%)" if run.a.floors else ""),
         "met": goodput >= share * run.capacity * live},
        {"name": "RSS, fds and threads: the trend's rise after the last restart",
         "value": "; ".join(f"r{k}: rss {v['rss'][1]:+.1%}, fds {v['fds'][1]:+.1%}, threads {v['threads'][1]:+.1%}"
                            for k, v in leaks.items()),
         "target": "within 5%" + (" (floor 10%)" if run.a.floors else ""),
         "met": all(ok for v in leaks.values() for ok, _ in v.values())},
        {"name": "health Check p99, ms (failed while up)",
         "value": f"{p99(health_ms):.1f} ({health_failed})", "target": "<= 50 (0)",
         "met": p99(health_ms) <= 50 and health_failed == 0},
        {"name": "SIGTERM drains, s", "value": ", ".join(f"{d:.2f}" for d in run.drains),
         "target": f"<= {run.grace}", "met": all(d <= run.grace for d in run.drains)},
        {"name": "bad input answered OK or INVALID_ARGUMENT", "value": bad, "target": "only those",
         "met": set(bad) <= {"OK", "INVALID_ARGUMENT"}},
    ]
    return {"minutes": run.a.minutes, "capacity": round(run.capacity, 3),
            "offered": round(1.5 * run.capacity, 3), "live_share": round(live, 3),
            "calls": len(calls), "by_status": by_status, "by_kind": by_kind,
            "unexpected": [c[:4] for c in unexpected[:10]], "wrong": run.wrong,
            "events": run.events,
            "targets": targets}


def table(summary):
    lines = [f"soak: {summary['minutes']} min, {summary['calls']} calls, capacity "
             f"{summary['capacity']} traces/s, offered {summary['offered']}; statuses "
             f"{summary['by_status']}", "", "| target | measured | bound | met |", "|---|---|---|---|"]
    for t in summary["targets"]:
        lines.append(f"| {t['name']} | {t['value']} | {t['target']} | {'yes' if t['met'] else 'NO'} |")
    lines += ["", "| s | event |", "|---:|---|"] + [f"| {t} | {w} |" for t, w in summary["events"]]
    lines += [f"wrong: {kind}: {got}; wanted {want}" for kind, got, want in summary["wrong"]]
    return "\n".join(lines)


def write_timeline(run, out):
    with open(out / "timeline.csv", "w") as f:
        f.write("t_s,replica,rss_kib,fds,threads\n")
        for row in run.samples:
            f.write(",".join(map(str, row)) + "\n")
    # The RSS plot: one line a replica, the events as marks along the top.
    w, h, pad = 800, 320, 40
    top = max((s[2] for s in run.samples), default=1) / 1024 * 1.1
    x = lambda t: pad + (w - 2 * pad) * t / run.duration  # noqa: E731
    y = lambda mib: h - pad - (h - 2 * pad) * mib / top  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-size="11">',
             f'<text x="{pad}" y="14">RSS of each replica (MiB) over the soak (s); marks: faults</text>',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>',
             f'<text x="{pad}" y="{h - 10}">0</text><text x="{w - pad}" y="{h - 10}">{run.duration:.0f}</text>',
             f'<text x="4" y="{y(top / 1.1) + 4:.0f}">{top / 1.1:.0f}</text>']
    for r in run.replicas:
        pts = " ".join(f"{x(s[0]):.1f},{y(s[2] / 1024):.1f}" for s in run.samples if s[1] == r.k)
        parts.append(f'<polyline fill="none" stroke="{colors[r.k]}" points="{pts}"/>')
        parts.append(f'<text x="{w - pad + 4}" y="{30 + 14 * r.k}" fill="{colors[r.k]}">r{r.k}</text>')
    for t, _ in run.events:
        parts.append(f'<line x1="{x(t):.1f}" y1="{pad}" x2="{x(t):.1f}" y2="{pad + 8}" stroke="gray"/>')
    parts.append("</svg>")
    (out / "rss.svg").write_text("\n".join(parts) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=Path("runs/soak"))
    ap.add_argument("--binary", help="the retrace binary (default: target/release's, else on PATH)")
    ap.add_argument("--model", type=Path, default=CACHE / "smollm2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--floors", action="store_true",
                    help="hold goodput and the resources' trend to floors (60%%, 10%%): CI's short form")
    a = ap.parse_args(argv)
    a.binary = retrace_bin(a.binary, profiles=("release",))
    if not Path(a.binary).is_file():
        sys.exit(f"no binary at {a.binary}: build it (cargo build --release) or pass --binary")
    if not (a.model / "model.safetensors").is_file():
        sys.exit(f"no SmolLM2 f32 at {a.model}: run scripts/fetch-smollm2.sh --f32")
    a.out.mkdir(parents=True, exist_ok=True)
    random.seed(a.seed)
    judge = Judge()
    threading.Thread(target=judge.serve_forever, daemon=True).start()
    toml = a.out / "retrace.toml"
    toml.write_text(config(a.model, judge.server_address[1], GRACE_S))
    replicas = [Replica(k, a.binary, toml, a.out) for k in range(3)]
    for r in replicas:
        r.start()
    for r in replicas:
        r.wait_serving()
    pool = traces(ROOT / "tests" / "fixtures" / "processbench" / "gsm8k.json")
    client = Client([r.address for r in replicas], timeout=DEADLINE_S, retries=4)
    refs = reference(client, pool)
    sustained = capacity(client, pool, seconds=max(10.0, 0.05 * a.minutes * 60))
    print(f"capacity: {sustained:.2f} traces/s over three replicas; offering {1.5 * sustained:.2f}",
          flush=True)
    run = Run(a, replicas, client, pool, refs, judge, sustained, DEADLINE_S, GRACE_S)
    run.go()
    summary = summarize(run)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    write_timeline(run, a.out)
    print(table(summary))
    client.close()
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
            r.proc.wait(timeout=GRACE_S + 30)
    judge.shutdown()
    return 0 if all(t["met"] for t in summary["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
