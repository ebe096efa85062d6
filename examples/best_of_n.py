"""Best-of-N reranking with Client.rank: for each question in a JSONL file of candidates,
judge all N chains of thought in one Rank call and print the best one.

    python examples/best_of_n.py [examples/data/candidates.jsonl]

Each line: {"id", "question", "candidates": [raw text, ...], "answer" (optional, shown only)}.
The server segments each candidate's text into steps (blank-line paragraphs, else lines).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _server import retrace_server
from retrace_client import Client

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "candidates.jsonl"


def main(path: Path) -> int:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    with retrace_server() as endpoint, Client(endpoint.address) as client:
        for row in rows:
            ranking = client.rank(row["question"], row["candidates"], id=row["id"])
            best = ranking.best
            scores = {c.index: c.verdict.trace_score for c in ranking.ranked}
            # The server's order is by trace score, best first; say so if it ever isn't.
            ordered = [scores[i] for i in ranking.order]
            if ordered != sorted(ordered, reverse=True):
                print(f"{row['id']}: ranking is not by trace score: {ranking.order}", file=sys.stderr)
                return 1
            print(f"== {row['id']}: {row['question']}")
            print(f"   order (best first): {ranking.order}; trace scores: "
                  + ", ".join(f"#{i}={scores[i]:.3f}" for i in range(len(row["candidates"]))))
            first = best.verdict.first_error_index
            print(f"   best: candidate #{best.index} (trace score {best.verdict.trace_score:.3f}, "
                  f"first error {'none' if first < 0 else f'at step {first}'}; gold answer {row.get('answer', '?')})")
            for line in row["candidates"][best.index].splitlines():
                if line.strip():
                    print(f"     | {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DATA))
