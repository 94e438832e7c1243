"""The loop of every pipeline rank but 0: `python -m engine.pipeline.worker` (started by launch.py).

It reads its WorkerSpec from standard input, joins torch.distributed, loads its stage's part of the
model and its KV cache, says it is ready (or why it is not) through the rendezvous store, then
repeats: receive a command from rank 0, receive the previous stage's hidden states, run its blocks,
send the result on (hidden states to the next stage; logits, from the last stage, back to rank 0).
It exits on STOP, and at once when its standard input closes (rank 0 ended, however it ended).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading

import torch
import torch.distributed as dist

from engine.errors import BonsaiError
from engine.pipeline.launch import STORE_TIMEOUT, Links, WorkerSpec, init_groups
from engine.pipeline.protocol import CALIBRATE, PREPARE, STATE_OPS, STOP
from engine.pipeline.stage import StageExecutor

log = logging.getLogger("bonsai.pipeline.worker")


def _exit_when_driver_ends() -> None:
    sys.stdin.buffer.read()  # returns at end-of-file: rank 0 closed the pipe or died
    os._exit(0)


def serve(links: Links, executor: StageExecutor) -> None:
    stage = executor.stage
    hidden_size, vocab = executor.loaded.config.hidden_size, executor.loaded.config.vocab_size
    while True:
        cmd = links.recv_command()
        links.flush_sends()  # the previous pass's sends: done before their buffers are reused
        if cmd.op == STOP:
            return
        if cmd.op == PREPARE:
            executor.prepare_rows(cmd.arg)
            continue
        if cmd.op in STATE_OPS:
            executor.run_state(cmd)
            continue
        x = links.recv(cmd.hidden_shape(hidden_size), executor.hidden_dtype(cmd), stage.rank - 1)
        out = executor.run(cmd, x)
        if cmd.op == CALIBRATE:
            executor.start_steps()
        if not stage.gives_logits:
            links.send(out, stage.rank + 1)
        elif cmd.wants_output:
            assert out.shape == cmd.output_shape(vocab), (out.shape, cmd)
            links.send(out.float(), 0, back=True)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s [pipeline worker] %(message)s")
    size = int.from_bytes(sys.stdin.buffer.read(8), "little")
    spec: WorkerSpec = pickle.loads(sys.stdin.buffer.read(size))
    threading.Thread(target=_exit_when_driver_ends, daemon=True).start()
    stage = spec.stages[spec.rank]
    store = dist.TCPStore("127.0.0.1", spec.store_port, len(spec.stages), is_master=False, timeout=STORE_TIMEOUT)
    links = Links(spec.rank, spec.stages, spec.backend, store, device=torch.device(stage.device))
    if stage.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // len(spec.stages)))
    init_groups(links)
    try:
        run = spec.run
        run.limit_memory(stage.device)
        loaded = spec.source.load(stage.device, stage)
        executor = StageExecutor(loaded, stage, run.max_seq_len, run.num_slots, run.kv_type, run.fast_decode)
        if not executor.needs_calibration:  # else after the CALIBRATE pass
            executor.start_steps()
    except Exception as e:  # noqa: BLE001 — rank 0 prints it as the one line of its error
        message = str(e) if isinstance(e, BonsaiError) else f"{type(e).__name__}: {e}"
        store.set(f"ready/{spec.rank}", (message.splitlines() or [type(e).__name__])[0])  # one line (an OOM has several)
        raise
    store.set(f"ready/{spec.rank}", "ok")
    try:
        serve(links, executor)
    finally:
        links.closed = True
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
