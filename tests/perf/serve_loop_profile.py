"""Where the server's engine loop spends its time: SmolLM2 on the CPU, N streams in flight, each
stream's events turned into SSE chunks on an asyncio loop exactly as `bonsai serve` does (no HTTP
sockets), with cProfile (each thread's CPU time) on the engine thread and on the event loop's thread.

    python tests/perf/serve_loop_profile.py --streams 8 --requests 16 --max-tokens 48 [--temperature 0.8]

Prints tok/s, the engine thread's time split into model forwards and the host work around them
(sampling, detokenizing, events: per generated token), then the top functions of each thread.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import threading
import time
from types import SimpleNamespace

import torch

from engine.sources import store
from engine.weights.loader import load_model
from engine.runtime.runner import ModelRunner
from engine.decoding.sampling import SamplingParams
from engine.decoding.engine import Engine
from engine.decoding.sequence import Request
from engine.server.openai_api import _stream
from engine.server.serving import Generation
from engine.server.engine_thread import EngineThread

QUESTIONS = ["Write a Python function that reverses a string.", "What is the capital of France?",
             "Explain photosynthesis in two sentences.", "List three prime numbers greater than 100.",
             "Translate 'good morning' into Spanish and German.", "Summarize the plot of Hamlet.",
             "What is 17 times 23?", "Give me a haiku about autumn."]
IDLE = ("acquire", "poll", "select")  # waiting for work (a lock, the event loop's selector)
# parts of the engine thread's host work: (file suffix, function) whose cumulative CPU time is shown
PARTS = {"Sequence.on_logits (token -> text -> events)": [("decoding/sequence.py", "on_logits")],
         "  detokenizing (StreamDecoder.push)": [("engine/decoding/detokenize.py", "push")],
         "  events to the event loop": [("server/relay.py", "post"), ("serve_loop_profile.py", "emit"),
                                        ("profile_main.py", "emit")],
         "picking the tokens (sample_rows)": [("engine/decoding/sampling.py", "sample_rows")]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8, help="requests in flight (and slots)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top", type=int, default=18, help="functions listed per thread")
    ap.add_argument("--budget", type=int, default=None, help="server.max_prefill_tokens_per_step")
    ap.add_argument("--dump", default=None, help="write PREFIX.engine.prof and PREFIX.loop.prof (pstats files)")
    ap.add_argument("--emit", choices=("relay", "direct"), default="relay",
                    help="events through the server's EventRelay, or one call_soon_threadsafe per event")
    args = ap.parse_args()
    path = store.find_pulled(store.DEFAULT_MODEL) or store.pull(store.DEFAULT_MODEL)
    loaded = load_model(path, "cpu", weight_dtype=torch.float32)  # what weight_dtype: auto picks for slots
    tok = loaded.require_tokenizer()
    runner = ModelRunner(loaded, max_seq_len=512, num_slots=args.streams, prefill_chunk_size=256)
    extra = {} if args.budget is None else {"prefill_budget": args.budget}
    engine = Engine(runner, tok, 512, max_queue=args.requests, **extra)
    thread = EngineThread(engine)
    # each thread's own CPU time: what the work costs, not how long a busy machine kept it waiting
    engine_prof, loop_prof = cProfile.Profile(time.thread_time), cProfile.Profile(time.thread_time)
    run = thread._run

    def profiled_run() -> None:
        engine_prof.enable()
        try:
            run()
        finally:
            engine_prof.disable()
    thread._thread = threading.Thread(target=profiled_run, name="bonsai-engine", daemon=True)
    thread.start()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in QUESTIONS]
    served = SimpleNamespace(engine=engine, alive=True)
    params = SamplingParams(temperature=args.temperature, top_p=0.95 if args.temperature else 1.0, seed=1)

    relays: dict = {}

    async def one(i: int, sem: asyncio.Semaphore) -> tuple[int, int]:
        async with sem:
            loop = asyncio.get_running_loop()
            job = Request(prompts[i % len(prompts)], max_tokens=args.max_tokens, sampling=params, id=f"r{i}")
            gen = Generation(served, [job], relays)  # emit through the relay
            if args.emit != "relay":
                def emit(event, queue=gen.queue):
                    loop.call_soon_threadsafe(queue.put_nowait, (0, event))
                job.emit = emit
            gen.submit()
            chunks = bytes_out = 0
            async for piece in _stream(gen, (job.id, "m", 0), True, True, ""):
                chunks += 1
                bytes_out += len(piece)
            return chunks, bytes_out

    async def all_requests() -> list[tuple[int, int]]:
        sem = asyncio.Semaphore(args.streams)
        return await asyncio.gather(*(one(i, sem) for i in range(args.requests)))

    def on_loop() -> list[tuple[int, int]]:
        loop_prof.enable()
        try:
            return asyncio.run(all_requests())
        finally:
            loop_prof.disable()

    start = time.perf_counter()
    results = on_loop()
    wall = time.perf_counter() - start
    thread.stop()
    tokens = engine.metrics.generated_tokens
    print(f"{args.requests} requests, {args.streams} in flight, T={args.temperature}: {tokens} tokens in {wall:.2f} s "
          f"= {tokens / wall:.1f} tok/s; {engine.metrics.decode_steps} decode steps "
          f"(mean {engine.metrics.decode_rows / max(engine.metrics.decode_steps, 1):.2f} rows), "
          f"{getattr(engine.metrics, 'prefill_chunks', '?')} prefill chunks; {sum(c for c, _ in results)} SSE chunks")
    stats = pstats.Stats(engine_prof)
    # the model's own time: every nn.Module call (recursive calls are counted once by cProfile)
    model = sum(ct for (file, _, name), (_, _, _, ct, _) in stats.stats.items()
                if name == "_call_impl" and file.endswith("torch/nn/modules/module.py"))
    busy = sum(tt for (_, _, name), (_, _, tt, _, _) in stats.stats.items() if not any(w in name for w in IDLE))
    host = busy - model
    print(f"engine thread (CPU time): {busy:.2f} s busy = model {model:.2f} s + host {host:.2f} s "
          f"({1e6 * host / max(tokens, 1):.0f} us per generated token, {100 * host / max(busy, 1e-9):.1f}% of busy)")
    for part, where in PARTS.items():
        seconds = sum(ct for (file, _, name), (_, _, _, ct, _) in stats.stats.items()
                      if any(file.endswith(suffix) and name == fn for suffix, fn in where))
        print(f"  {part}: {1e6 * seconds / max(tokens, 1):.0f} us per token")
    if args.dump:
        engine_prof.dump_stats(f"{args.dump}.engine.prof")
        loop_prof.dump_stats(f"{args.dump}.loop.prof")
    loop_busy = sum(tt for (_, _, name), (_, _, tt, _, _) in pstats.Stats(loop_prof).stats.items()
                    if not any(w in name for w in IDLE))
    print(f"event-loop thread (CPU time): {loop_busy:.2f} s busy ({1e6 * loop_busy / max(tokens, 1):.0f} us per generated token)")
    for title, prof in (("engine thread", engine_prof), ("event-loop thread", loop_prof)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        lines = out.getvalue().splitlines()
        first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
        print(f"\n-- {title}, by own time --")
        print("\n".join(lines[first:]))


if __name__ == "__main__":
    main()
