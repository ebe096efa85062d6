"""A real `retrace serve` process on free 127.0.0.1 ports, for tests and examples.

    with LocalServer(EVALUATORS_TOML) as server:
        client = Client(server.address)

The config is written to a temporary file: a [server] table with the chosen addresses (plus
`server_extra` lines), then the caller's evaluator tables. The server counts as started once
grpc.health.v1 reports retrace.v1.Evaluator SERVING; its log is kept for the error message
when it dies first. The binary is `binary`, else $RETRACE_BIN, else `retrace` on PATH.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ._proto import SERVICE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_binary() -> str:
    found = os.environ.get("RETRACE_BIN") or shutil.which("retrace")
    if not found:
        raise FileNotFoundError("no retrace binary: set RETRACE_BIN or put `retrace` on PATH")
    return found


@functools.lru_cache(maxsize=None)
def serves_http(binary: str) -> bool:
    """Whether this build of `retrace serve` has the HTTP endpoint (a --http-addr flag)."""
    out = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True, timeout=60)
    return "--http-addr" in out.stdout


class ServerDied(RuntimeError):
    pass


class LocalServer:
    def __init__(
        self,
        evaluators: str,
        *,
        binary: str | None = None,
        server_extra: str = "",
        env: dict | None = None,
        root_certificates: bytes | None = None,
        startup_timeout: float = 120.0,
    ):
        self.binary = binary or default_binary()
        self.evaluators = evaluators
        self.server_extra = server_extra
        self.env = env
        # A build with the HTTP endpoint listens on 0.0.0.0:8080 unless told otherwise, so every
        # server here gets a free port of its own for it.
        self.http = serves_http(self.binary)
        self.root_certificates = root_certificates
        self.startup_timeout = startup_timeout
        self.address: str | None = None
        self.http_address: str | None = None
        self.metrics_address: str | None = None
        self._proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="retrace-test-")

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "server.log"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def _config(self) -> str:
        lines = ["[server]", f'grpc_addr = "{self.address}"', f'metrics_addr = "{self.metrics_address}"']
        if self.http_address:
            lines.append(f'http_addr = "{self.http_address}"')
        return "\n".join(lines) + "\n" + self.server_extra + "\n\n" + self.evaluators + "\n"

    def start(self) -> "LocalServer":
        # A port picked free can be taken before the server binds it; a few tries cover that.
        for attempt in range(3):
            self.address = f"127.0.0.1:{free_port()}"
            self.metrics_address = f"127.0.0.1:{free_port()}"
            self.http_address = f"127.0.0.1:{free_port()}" if self.http else None
            config = Path(self._dir.name) / "retrace.toml"
            config.write_text(self._config())
            env = {**os.environ, **(self.env or {})}
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    [self.binary, "serve", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT, env=env
                )
            try:
                self._wait_serving()
                return self
            except ServerDied:
                if attempt == 2 or "in use" not in self.log().lower():
                    raise
        raise AssertionError("unreachable")

    def _wait_serving(self) -> None:
        until = time.monotonic() + self.startup_timeout
        if self.root_certificates:
            creds = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
            channel = grpc.secure_channel(self.address, creds)
        else:
            channel = grpc.insecure_channel(self.address)
        with channel as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < until:
                if self._proc.poll() is not None:
                    raise ServerDied(f"retrace serve exited with {self._proc.returncode}:\n{self.log()[-4000:]}")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"retrace serve was not SERVING within {self.startup_timeout}s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._dir.cleanup()
