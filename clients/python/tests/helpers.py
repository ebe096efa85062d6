"""Shared test data and a Prometheus reader for counting the requests a server saw."""

from __future__ import annotations

import re
import urllib.request

from retrace_client.testing import LocalServer

# A trace scored in a batch with others and the same trace alone differ by f32 rounding: the
# GEMM's blocking follows the batch's rows (about 1e-6 on the AVX-512 kernel). Scores of
# different traces differ by far more, so a mix-up still fails.
SAME_SCORE = 1e-5

QUESTION = "What is 2+3*4?"
STEPS = ["3*4 = 12.", "2+12 = 14."]
TEXT = "3*4 = 12.\n\n2+12 = 14."
# Traces for the judge: FakeJudge flags the first step holding a marker (fake_judge.MARKERS).
JUDGE_CASES = [
    ["3*4 = 12.", "2+12 = 14."],
    ["3*4 = 12.", "2+12 = 15, WRONG.", "So 15."],
    ["Read the question as 2*3+4 (MISREAD).", "That is 10."],
    ["Multiplication is INVENTED to come last.", "So 20.", "WRONG again."],
]


_SAMPLE = re.compile(r'^retrace_requests_total\{(.*)\} (\S+)$')


def requests_total(server: LocalServer, **labels: str) -> float:
    """Sum of retrace_requests_total over the series whose labels match `labels`."""
    text = urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total
