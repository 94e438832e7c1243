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


def tiny_serve_config(directory: Path, smollm2_gguf: Path, slots: int = 2, context: int = 256, **server) -> Path:
    """A serve.yaml for a tiny random model (tests/gguf_tiny.py: 2 layers, SmolLM2's tokenizer and chat
    template) on the CPU; `server`: keys of the config's server section."""
    from gguf import GGMLQuantizationType

    from tests.gguf_tiny import write_tiny_gguf
    model = write_tiny_gguf(directory / "tiny.gguf", smollm2_gguf, GGMLQuantizationType.F16)
    lines = "".join(f"  {key}: {value}\n" for key, value in server.items())
    config = directory / "serve.yaml"
    config.write_text(f"model:\n  path: {model}\n  max_context: {context}\n"
                      f"runtime:\n  device: cpu\n  max_batch_size: {slots}\n" + (f"server:\n{lines}" if lines else ""))
    return config


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")
