"""Gives an example a retrace server to talk to.

With $RETRACE_ADDRESS set, that server (and $RETRACE_HTTP_ADDRESS, when set, for its HTTP
endpoint). Otherwise a `retrace serve` started here on the repo's tiny fixture PRM, which runs
anywhere in a second but judges like noise: the examples show the plumbing, not good verdicts.
The binary is $RETRACE_BIN, default the repo's target/debug/retrace.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from retrace_client.testing import LocalServer

REPO = Path(__file__).resolve().parents[1]
TINY_PRM = f"""
[[evaluator]]
name = "tiny"
kind = "prm"
family = "qwen2-math-prm"
model = "{REPO / 'tests' / 'fixtures' / 'tiny' / 'qwen2-math-prm'}"
"""


@dataclass
class Endpoint:
    address: str
    # host:port of the HTTP endpoint (/get_reward), or None when there is none.
    http_address: str | None


@contextlib.contextmanager
def retrace_server():
    if os.environ.get("RETRACE_ADDRESS"):
        yield Endpoint(os.environ["RETRACE_ADDRESS"], os.environ.get("RETRACE_HTTP_ADDRESS") or None)
        return
    binary = os.environ.get("RETRACE_BIN") or str(REPO / "target" / "debug" / "retrace")
    with LocalServer(TINY_PRM, binary=binary) as server:
        print(f"started retrace serve on {server.address} (tiny fixture PRM)")
        yield Endpoint(server.address, server.http_address)
