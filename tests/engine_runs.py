"""Tests' shorthand: one request through the engine over a runner (offline generation)."""
from __future__ import annotations

from engine.decoding.engine import Engine
from engine.decoding.generate import generate_text
from engine.decoding.sequence import Request


def engine_over(runner, tokenizer, drafter=None, k: int = 4, **options) -> Engine:
    """An engine over `runner` (with `drafter` on every slot: speculative decoding, k drafts a step)."""
    drafters = None if drafter is None else [drafter] * len(runner.cache.slots)
    return Engine(runner, tokenizer, drafters=drafters, num_draft_tokens=k, **options)


def run_engine(runner, tokenizer, prompt: list[int], drafter=None, k: int = 4, **request):
    """(text, token ids, finish reason, stats) of `prompt` with the Request fields given."""
    return generate_text(engine_over(runner, tokenizer, drafter, k), Request(list(prompt), **request))


class Threaded:
    """An engine as the server drives it, from its own thread (engine/server/engine_thread.py)."""

    def __init__(self, engine: Engine):
        from engine.server.engine_thread import EngineThread
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "thread", EngineThread(engine).start())

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def __setattr__(self, name: str, value) -> None:  # a test's monkeypatch reaches the engine
        setattr(self.engine, name, value)

    def __delattr__(self, name: str) -> None:  # monkeypatch's undo: the engine's own attribute again
        self.engine.__dict__.pop(name, None)

    @property
    def alive(self) -> bool:
        return self.thread.alive

    @property
    def _thread(self):
        return self.thread._thread

    def stop(self) -> None:
        self.thread.stop()


def spec_engine(runner, tokenizer, config, **options) -> Engine:
    """An engine drafting with a SpeculativeConfig (one drafter per slot, as open_run's)."""
    from engine.speculative.config import build_drafters
    drafters = build_drafters(config, runner.loaded, runner.max_seq_len, len(runner.cache.slots))
    return Engine(runner, tokenizer, drafters=drafters, num_draft_tokens=config.num_draft_tokens,
                  spec_method=config.method, **options)
