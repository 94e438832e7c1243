"""Starting a pipeline: the worker processes, torch.distributed between them, and their end.

Rank 0 is the process that asked (the CLI, the server, a test): it starts one worker process per
further stage (`python -m engine.pipeline.worker`), hands it its WorkerSpec through its standard
input, and keeps that pipe open: a worker exits when it reads end-of-file there (the driver ended,
however it ended: normal exit, error, Ctrl-C, kill), or on the STOP command (`Links.close`).
Workers ignore SIGINT (Ctrl-C in a terminal reaches the whole process group): the driver decides.

Three process groups: commands over gloo (small CPU tensors, also on GPUs), hidden states forward
(stage k → k+1) and logits back (last → 0) each over the data backend (nccl on GPUs, gloo on CPUs).
Forward and back are separate groups so that their transfers never queue behind each other.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.errors import BonsaiError
from engine.pipeline.protocol import WORDS, Command
from engine.pipeline.split import Stage

log = logging.getLogger(__name__)

COMMAND_TIMEOUT = timedelta(days=7)  # a worker waits for the next command as long as the server idles
DATA_TIMEOUT = timedelta(minutes=10)  # hidden states / logits follow their command within this
STORE_TIMEOUT = timedelta(minutes=5)  # the workers start Python, import torch and join within this
READY_TIMEOUT_S = 1800.0  # loading a stage (a 27B model's share from disk) within this


@dataclass(frozen=True)
class ModelSource:
    """What each stage loads its part of: a model path, or an architecture with generated weights."""
    path: str | None = None  # a resolved model path (GGUF, HF dir or bonsai checkpoint)
    architecture: object = None  # a ModelConfig: load_format dummy
    name: str = ""
    weight_dtype: torch.dtype | None = None
    weight_format: object = None  # engine.weights.formats.WeightFormat
    seed: int = 0
    cpu_int4: bool = False  # a CPU stage runs a GGUF's block matrices as stored (load_model)
    cpu_kernels: str = "auto"  # by which kernels (load_model)
    narrow_head: str | None = None  # a CPU stage's output layer: float16 / int8, top logits exact (load_model)
    unpack_slice_bytes: int = 0  # prefill's unpacked Wᵀ whole or in slices, as the plan chose (packed_linear)

    def load(self, device: str, stage: Stage):
        from engine.weights.loader import load_dummy, load_model
        from engine.weights.packed_linear import set_unpack_slice
        if self.architecture is not None:
            loaded = load_dummy(self.architecture, self.name, device=device, weight_format=self.weight_format,
                                seed=self.seed, stage=stage)
        else:
            loaded = load_model(self.path, device=device, weight_dtype=self.weight_dtype,
                                weight_format=self.weight_format, stage=stage, cpu_int4=self.cpu_int4,
                                narrow_head=self.narrow_head, cpu_kernels=self.cpu_kernels)
        set_unpack_slice(loaded.model, self.unpack_slice_bytes)
        return loaded


@dataclass(frozen=True)
class RunSpec:
    """A stage's runner settings (the same on every stage)."""
    max_seq_len: int
    num_slots: int = 1
    kv_type: str = "bf16"
    fast_decode: bool | None = None
    max_gpu_memory: int | None = None  # bytes each GPU's allocator is capped at (engine.memory.limit)

    def limit_memory(self, device: str) -> None:
        if self.max_gpu_memory is not None:
            from engine.memory.limit import limit_device_memory
            limit_device_memory(self.max_gpu_memory, device)


@dataclass(frozen=True)
class WorkerSpec:
    source: ModelSource
    run: RunSpec
    stages: tuple[Stage, ...]
    backend: str
    store_port: int
    rank: int


@dataclass
class Links:
    """This rank's end of the pipeline's process groups."""
    rank: int
    stages: tuple[Stage, ...]
    backend: str
    store: object
    forward: object = None  # group: hidden states stage k → k+1
    back: object = None  # group: logits last → 0
    commands: object = None  # gloo group: rank 0 → every worker
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sends: list = field(default_factory=list)  # (work, tensor) of transfers still in flight
    procs: list = field(default_factory=list)  # rank 0: the workers' processes
    closed: bool = False
    failure: str | None = None  # rank 0: why a worker ended early

    @property
    def world(self) -> int:
        return len(self.stages)

    @property
    def last(self) -> int:
        return self.world - 1

    # -- commands (rank 0 → workers, CPU tensors over gloo) --
    def send_command(self, cmd: Command) -> None:
        words = cmd.encode()
        for rank in range(1, self.world):
            self.sends.append((dist.isend(words, rank, group=self.commands), words))

    def recv_command(self) -> Command:
        words = torch.empty(WORDS, dtype=torch.int64)
        dist.recv(words, 0, group=self.commands)
        return Command.decode(words)

    # -- data (the backend's device tensors) --
    def send(self, t: torch.Tensor, dst: int, back: bool = False) -> None:
        t = t.contiguous()
        self.sends.append((dist.isend(t, dst, group=self.back if back else self.forward), t))

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, back: bool = False) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, src, group=self.back if back else self.forward)
        return t

    def post_recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, back: bool = False):
        """Start receiving now (before this rank's own work): (work, tensor) to `finish`."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.irecv(t, src, group=self.back if back else self.forward), t

    def finish(self, pending) -> torch.Tensor:
        work, t = pending
        work.wait()
        return t

    def flush_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()

    # -- the end --
    def close(self, timeout: float = 20.0) -> None:
        """Rank 0: STOP to every worker, wait for them to exit (killed after `timeout`), then leave
        torch.distributed. Safe to call twice and after a failure."""
        if self.closed:
            return
        self.closed = True
        if self.rank == 0 and self.failure is None:
            try:
                self.send_command(Command(0))
                self.flush_sends()
            except Exception as e:  # noqa: BLE001 — a worker already gone: its pipe's end stops the rest
                log.debug("pipeline STOP not delivered: %s", e)
        for proc in self.procs:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pipeline worker %d did not exit; killing it", proc.pid)
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def init_groups(links: Links, timeout: timedelta = DATA_TIMEOUT) -> None:
    """torch.distributed on this rank (every rank calls this, in the same order)."""
    from torch.distributed import PrefixStore
    if links.backend == "nccl":  # GPU-specific: each rank drives its own GPU
        torch.cuda.set_device(links.device)
    dist.init_process_group(links.backend, store=PrefixStore("bonsai-pipeline", links.store), rank=links.rank,
                            world_size=links.world, timeout=timeout)
    links.forward = dist.group.WORLD
    links.back = dist.new_group(list(range(links.world)), timeout=timeout, backend=links.backend)
    links.commands = dist.new_group(list(range(links.world)), timeout=COMMAND_TIMEOUT, backend="gloo")
    _first_transfers(links)


def _first_transfers(links: Links) -> None:
    """One small transfer over every link the pipeline uses, in one order on every rank. NCCL makes a
    pair's communicator on its first transfer, blocking until both ends are there: made now, it
    cannot wait on a transfer that a rank posts later in a pass (rank 0 posts its logits receive
    before sending stage 0's output). Gloo needs none of it; the same code checks its links."""
    one = torch.zeros(1, device=links.device)
    if links.rank > 0:
        dist.recv(one, links.rank - 1, group=links.forward)
    if links.rank < links.last:
        dist.send(one, links.rank + 1, group=links.forward)
    if links.rank == links.last:
        dist.send(one, 0, group=links.back)
    elif links.rank == 0:
        dist.recv(one, links.last, group=links.back)


def _package_root() -> str:
    import engine
    return str(Path(engine.__file__).resolve().parents[1])


def start_workers(source: ModelSource, run: RunSpec, stages: list[Stage], backend: str) -> Links:
    """Rank 0: start a worker for every stage but the first and join them in torch.distributed.
    Returns rank 0's links; the workers load their parts meanwhile (`wait_ready`)."""
    if dist.is_initialized():
        raise BonsaiError("a pipeline is already running in this process: close it first")
    store = dist.TCPStore("127.0.0.1", 0, len(stages), is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    links = Links(0, tuple(stages), backend, store, device=torch.device(stages[0].device))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_package_root(), os.environ.get("PYTHONPATH"))
                                                       if p)}
    for stage in stages[1:]:
        spec = WorkerSpec(source, run, tuple(stages), backend, store.port, stage.rank)
        proc = subprocess.Popen([sys.executable, "-m", "engine.pipeline.worker"], stdin=subprocess.PIPE,
                                stdout=2, env=env)  # its prints: to our stderr (fd 2), never our stdout
        data = pickle.dumps(spec)
        proc.stdin.write(len(data).to_bytes(8, "little") + data)
        proc.stdin.flush()
        links.procs.append(proc)
    try:
        init_groups(links)
    except Exception:
        links.failure = "torch.distributed did not start"
        links.close(timeout=5)
        raise
    threading.Thread(target=_watch, args=(links,), name="bonsai-pipeline-watch", daemon=True).start()
    return links


def wait_ready(links: Links) -> None:
    """Rank 0: until every worker has loaded its part (or one failed: its error, one line)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = {stage.rank: stage for stage in links.stages[1:]}
    while pending:
        for rank in list(pending):
            key = f"ready/{rank}"
            if links.store.check([key]):
                message = links.store.get(key).decode()
                if message != "ok":
                    links.failure = message
                    links.close(timeout=5)
                    raise BonsaiError(f"pipeline stage {rank} ({pending[rank].device}): {message}")
                del pending[rank]
            elif links.procs[rank - 1].poll() is not None:
                links.failure = f"exited with code {links.procs[rank - 1].returncode} while loading"
                links.close(timeout=5)
                raise BonsaiError(f"pipeline stage {rank} ({pending[rank].device}) {links.failure}; "
                                  "its error is above")
        if time.monotonic() > deadline:
            links.close(timeout=5)
            raise BonsaiError(f"pipeline stages {sorted(pending)} did not load within {READY_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def _watch(links: Links) -> None:
    """Rank 0: notice a worker that ends before the pipeline is closed. With gloo the driver's next
    transfer then fails; NCCL cannot tell a dead peer from a slow one, so the driver exits."""
    while not links.closed:
        for proc in links.procs:
            if proc.poll() is not None and not links.closed:
                links.failure = f"pipeline worker {proc.pid} exited with code {proc.returncode}"
                log.error("%s; the pipeline cannot go on", links.failure)
                if links.backend == "nccl":  # GPU-specific: a transfer to it would wait until the timeout
                    time.sleep(5)
                    if not links.closed:
                        os._exit(1)
                return
        time.sleep(0.2)
