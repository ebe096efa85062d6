"""Session fixtures: real `retrace serve` processes (the binary is $RETRACE_BIN, default the
repo's target/debug/retrace) on the repo's tiny fixture PRM and a judge backed by FakeJudge.

- server: evaluators "tiny" (prm, the default) and "judge"
- auth_server: "tiny" behind bearer tokens read from auth_tokens_env
- tight_server: "judge" with max_in_flight = 1, to provoke RESOURCE_EXHAUSTED
- tls_server: "tiny" over TLS with the repository's test certificate for 127.0.0.1 (tests/fixtures/tls)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fake_judge import FakeJudge
from retrace_client.testing import LocalServer

REPO = Path(__file__).resolve().parents[3]
BINARY = os.environ.get("RETRACE_BIN") or str(REPO / "target" / "debug" / "retrace")
TINY = REPO / "tests" / "fixtures" / "tiny" / "qwen2-math-prm"
TOKENS = ("tok-alpha", "tok-beta")

PRM = f"""
[[evaluator]]
name = "tiny"
kind = "prm"
family = "qwen2-math-prm"
model = "{TINY}"
"""


def judge_table(base_url: str, name: str = "judge") -> str:
    # No retries and no cache: every request reaches the fake, so tests see what was sent.
    return f"""
[[evaluator]]
name = "{name}"
kind = "judge"
base_url = "{base_url}"
model = "fake-judge"
retries = 0
cache_entries = 0
"""


@pytest.fixture(scope="session")
def binary() -> str:
    if not Path(BINARY).exists():
        pytest.fail(f"no retrace binary at {BINARY}; build it (cargo build) or set RETRACE_BIN")
    return BINARY


@pytest.fixture(scope="session")
def fake_judge():
    judge = FakeJudge().start()
    yield judge
    judge.stop()


@pytest.fixture(scope="session")
def server(binary, fake_judge):
    with LocalServer(PRM + judge_table(fake_judge.base_url), binary=binary,
                     server_extra='default_evaluator = "tiny"') as s:
        yield s


@pytest.fixture(scope="session")
def auth_server(binary):
    extra = 'auth_tokens_env = "RETRACE_TEST_TOKENS"'
    env = {"RETRACE_TEST_TOKENS": ",".join(TOKENS)}
    with LocalServer(PRM, binary=binary, server_extra=extra, env=env) as s:
        yield s


@pytest.fixture(scope="session")
def tight_server(binary, fake_judge):
    with LocalServer(judge_table(fake_judge.base_url), binary=binary, server_extra="max_in_flight = 1") as s:
        yield s


@pytest.fixture(scope="session")
def tls_files():
    # The repository's test CA and its leaf for localhost and 127.0.0.1 (scripts/fixtures/make_tls.sh).
    d = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "tls"
    return d / "cert.pem", d / "key.pem", d / "ca.pem"


@pytest.fixture(scope="session")
def tls_server(binary, tls_files):
    cert, key, ca = tls_files
    extra = f'tls_cert = "{cert}"\ntls_key = "{key}"'
    with LocalServer(PRM, binary=binary, server_extra=extra, root_certificates=ca.read_bytes()) as s:
        yield s
