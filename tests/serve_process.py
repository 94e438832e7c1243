"""Start a real `bonsai serve` process on 127.0.0.1 for the server tests, and stop it."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log: Path
    health: list = field(default_factory=list)  # (status, body) of every /health answer while starting

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=60) == 0, self.log.read_text()[-2000:]


def start_server(config: Path, log: Path, timeout: float = 300, threads: int | None = None) -> ServerProcess:
    """Run `bonsai serve --config CONFIG` on a free port; return once /health says ready. threads:
    torch's CPU threads in the server (1 for tiny models: on a shared machine extra threads of a
    small matmul only wait for each other)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    port = free_port()
    out = open(log, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "bonsai_cli", "serve", "--config", str(config),
                             "--port", str(port)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env=env)
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            r = httpx.get(server.url + "/health", timeout=5)
            server.health.append((r.status_code, r.json()))
            if r.status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not become ready: " + log.read_text()[-2000:])
