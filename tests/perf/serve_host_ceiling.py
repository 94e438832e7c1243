"""The server's host work alone (issue 20): the engine thread and the event loop's SSE streams exactly as `bonsai
serve` runs them (engine.server: EngineThread, Generation, openai_api._stream through the EventRelay), over a runner
whose passes cost nothing (random logits, no model). What it gives is the ceiling the host puts on a server: tokens a
second and µs a token at each concurrency, with the engine thread alone (no streams consumed) beside it, so the cost
of the two threads sharing one interpreter lock shows. No GPU; any tokenizer GGUF (tests/perf/tokenizer_gguf.py).

    python tests/perf/serve_host_ceiling.py .tok/smollm2.gguf --levels 1,8 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.decoding.engine import Engine  # noqa: E402
from engine.decoding.sequence import Request  # noqa: E402
from engine.runtime.kv_cache import KVSlot  # noqa: E402
from engine.runtime.runner import PENDING  # noqa: E402
from engine.server.engine_thread import EngineThread  # noqa: E402
from engine.server.openai_api import _stream  # noqa: E402
from engine.server.serving import Generation  # noqa: E402
from engine.sources.gguf_file import GGUFFile  # noqa: E402
from engine.sources.tokenizer import Tokenizer  # noqa: E402

PROMPT = list(range(1000, 1030))


class FreeRunner:
    """A runner whose passes cost nothing: each returns rows of a fixed table of random logits [64, V]."""

    def __init__(self, slots: int, vocab: int):
        self.cache = SimpleNamespace(slots=[KVSlot(i, 1 << 16) for i in range(slots)])
        self.device, self.prefill_chunk_size, self.max_seq_len = torch.device("cpu"), 512, 1 << 16
        self.loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab))
        self.takes_device_tokens = True
        self.table = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0))  # [64, V]
        self.calls = 0

    def slot(self, i: int) -> KVSlot:
        return self.cache.slots[i]

    def _logits(self, rows: int) -> torch.Tensor:
        self.calls += 1
        return self.table[(self.calls + torch.arange(rows)) % 64]  # [rows, V]

    def forward(self, slot: KVSlot, tokens, num_logits: int | None = 1) -> torch.Tensor:
        slot.tokens.extend([PENDING] * len(tokens) if isinstance(tokens, torch.Tensor) else tokens)
        return self._logits(1)

    def decode_batch(self, slots: list[KVSlot], tokens) -> torch.Tensor:
        held = [PENDING] * len(slots) if isinstance(tokens, torch.Tensor) else list(tokens)
        for s, t in zip(slots, held):
            s.tokens.append(t)
        return self._logits(len(slots))


def engine_alone(tok: Tokenizer, streams: int, tokens: int) -> float:
    """µs a token with the engine stepped on this thread, events dropped."""
    engine = Engine(FreeRunner(streams, tok.vocab_size), tok, lookahead=True)
    for i in range(streams):
        engine.submit(Request(list(PROMPT), max_tokens=tokens, ignore_eos=True, emit=lambda e: None))
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    return (time.perf_counter() - start) / max(engine.metrics.generated_tokens, 1) * 1e6


def served(tok: Tokenizer, streams: int, requests: int, tokens: int) -> tuple[float, float]:
    """(tok/s, µs a decode step) with the engine on its thread and every stream consumed on an event loop."""
    engine = Engine(FreeRunner(streams, tok.vocab_size), tok, 1 << 16, max_queue=requests, lookahead=True)
    thread = EngineThread(engine).start()
    server, relays = SimpleNamespace(engine=engine, alive=True), {}

    async def one(i: int, sem: asyncio.Semaphore) -> None:
        async with sem:
            job = Request(list(PROMPT), max_tokens=tokens, ignore_eos=True, id=f"r{i}")
            gen = Generation(server, [job], relays)
            gen.submit()
            async for _ in _stream(gen, (job.id, "m", 0), True, True, ""):
                pass

    async def run() -> None:
        sem = asyncio.Semaphore(streams)
        await asyncio.gather(*(one(i, sem) for i in range(requests)))

    start = time.perf_counter()
    try:
        asyncio.run(run())
    finally:
        thread.stop()
    wall = time.perf_counter() - start
    return engine.metrics.generated_tokens / wall, wall / max(engine.metrics.decode_steps, 1) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokenizer", type=Path, help="a GGUF with a tokenizer (metadata-only is enough)")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="generated a request")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = Tokenizer.from_gguf_metadata(GGUFFile(args.tokenizer).metadata)
    for c in (int(x) for x in args.levels.split(",")):
        alone, rates, steps = [], [], []
        for _ in range(args.rounds):  # interleaved: the machine's drift falls on both
            alone.append(engine_alone(tok, c, args.tokens))
            rate, step = served(tok, c, 4 * c, args.tokens)
            rates.append(rate)
            steps.append(step)
        print(f"c={c}: engine alone {statistics.mean(alone):.0f} ± {statistics.pstdev(alone):.0f} µs a token; "
              f"served {statistics.mean(rates):,.0f} ± {statistics.pstdev(rates):,.0f} tok/s = "
              f"{1e6 / statistics.mean(rates):.0f} µs a token, {statistics.mean(steps):.0f} µs a step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
