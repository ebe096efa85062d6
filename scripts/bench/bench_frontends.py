#!/usr/bin/env python3
"""What retrace's front doors cost, side by side in one run on one server and model.

Contenders, each scoring the same ProcessBench traces with CONCURRENCY requests in flight:
  grpc        the generated gRPC stub, one unary Evaluate per trace (the protocol, no wrapper)
  client      retrace_client.AsyncClient.evaluate (retries, deadlines, typed results on top)
  get_reward  OpenRLHF's POST /get_reward, one sample per request as recent OpenRLHF sends it
              (the ChatML prompt plus the response; the server finds the question and the steps)
Every contender sends the question and the steps as text the server segments, so all three score
the very same trace; their scores are compared. The server runs with its prefix cache off
(bench-frontends.sh), or every contender after the first would find the traces cached. Rounds
alternate which contender goes first.
Prints traces/s, p50 and p99 latency, and each one's throughput over direct gRPC's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp
import grpc

from retrace_client import AsyncClient
from retrace_client._proto import pb, pb_grpc

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def chatml(question: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def load(path: str, limit: int) -> list[tuple[str, str]]:
    with open(path) as f:
        rows = json.load(f)
    traces = []
    for row in rows[:limit]:
        steps = [s.strip() for s in row["steps"] if s.strip()]
        # Blank-line paragraphs are the server's first segmentation rule: one step each.
        if any("\n\n" in s for s in steps):
            steps = [" ".join(s.split()) for s in steps]
        traces.append((row["problem"].strip(), "\n\n".join(steps)))
    return traces


async def drive(n: int, concurrency: int, one) -> tuple[float, list[float], list[list[float]]]:
    """Scores traces 0..n-1 with `concurrency` workers; returns wall time, latencies, scores."""
    latencies: list[float] = []
    scores: list[list[float]] = [[] for _ in range(n)]
    next_i = iter(range(n))

    async def worker():
        for i in next_i:
            sent = time.perf_counter()
            scores[i] = await one(i)
            latencies.append(time.perf_counter() - sent)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, sorted(latencies), scores


def pct(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default="127.0.0.1:50051", help="the server's gRPC address")
    ap.add_argument("--http", default="127.0.0.1:8080", help="the server's HTTP address")
    ap.add_argument("--data", required=True, help="a ProcessBench split (JSON array)")
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--target-ratio", type=float, default=0.9,
                    help="fail unless every contender reaches this share of gRPC's throughput")
    ap.add_argument("--out", help="also write the Markdown table here")
    args = ap.parse_args()

    traces = load(args.data, args.limit)
    channel = grpc.aio.insecure_channel(args.address)
    stub = pb_grpc.EvaluatorStub(channel)
    client = AsyncClient(args.address, timeout=600)
    http = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=args.concurrency),
        timeout=aiohttp.ClientTimeout(total=600),
    )
    url = f"http://{args.http}/get_reward"

    async def by_grpc(i):
        q, text = traces[i]
        r = await stub.Evaluate(pb.EvaluateRequest(trace=pb.Trace(question=q, text=text)), timeout=600)
        return [s.score for s in r.steps]

    async def by_client(i):
        q, text = traces[i]
        v = await client.evaluate(q, text=text)
        return [s.score for s in v.steps]

    async def by_get_reward(i):
        q, text = traces[i]
        prompt = chatml(q)
        body = {"query": prompt + text + "<|im_end|>", "prompts": prompt, "labels": ""}
        async with http.post(url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"/get_reward answered {r.status}: {await r.text()}")
            reply = await r.json()
        # /get_reward answers the trace score; the step count checks it scored the same steps.
        return [reply["rewards"], reply["extra_logs"]["step_count"]]

    contenders = {"grpc": by_grpc, "client": by_client, "get_reward": by_get_reward}
    # Warm-up, not measured: connections, the model's first-touch pages.
    for one in contenders.values():
        await drive(min(8, len(traces)), 8, one)

    results: dict[str, list[tuple[float, list[float]]]] = {k: [] for k in contenders}
    scores: dict[str, list[list[float]]] = {}
    names = list(contenders)
    for round_ in range(args.rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for name in order:
            wall, lat, sc = await drive(len(traces), args.concurrency, contenders[name])
            results[name].append((wall, lat))
            scores[name] = sc
            print(f"bench: round {round_ + 1} {name:>10} {wall:6.2f} s", file=sys.stderr)

    # Same traces: gRPC's step scores, their minimum (the trace score), and the step counts agree.
    worst = 0.0
    for i, steps in enumerate(scores["grpc"]):
        worst = max(worst, max(abs(a - b) for a, b in zip(steps, scores["client"][i])))
        reward, count = scores["get_reward"][i]
        if count != len(steps):
            raise SystemExit(f"trace {i}: /get_reward scored {count} steps, gRPC {len(steps)}")
        worst = max(worst, abs(reward - min(steps)))

    n = len(traces)
    base = statistics.median(n / w for w, _ in results["grpc"])
    lines = [
        f"{n} ProcessBench traces ({args.data.rsplit('/', 1)[-1]}), concurrency {args.concurrency}, "
        f"medians of {args.rounds} alternating rounds; largest score difference {worst:.1e}",
        "",
        "| front door | traces/s | p50 latency | p99 latency | throughput vs gRPC |",
        "|---|---|---|---|---|",
    ]
    failed = []
    for name in names:
        rate = statistics.median(n / w for w, _ in results[name])
        p50 = statistics.median(pct(lat, 0.5) for _, lat in results[name])
        p99 = statistics.median(pct(lat, 0.99) for _, lat in results[name])
        ratio = rate / base
        lines.append(f"| {name} | {rate:.1f} | {p50 * 1e3:.0f} ms | {p99 * 1e3:.0f} ms | {ratio:.2f}x |")
        if ratio < args.target_ratio:
            failed.append(f"{name} reached {ratio:.2f}x of gRPC's throughput (target {args.target_ratio}x)")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    await http.close()
    await client.close()
    await channel.close()
    for f in failed:
        print(f"target missed: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
