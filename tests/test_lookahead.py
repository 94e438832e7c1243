"""The decode step launched ahead (engine.decoding.lookahead): on a GPU the next step runs while the host
turns the last one's tokens into events. Here on the CPU (asked for): outputs and every slot's cached tokens
equal to the engine without it, over batched requests that end in every way (end-of-sequence token, stop
string, max_tokens, cancelled mid-way, a request arriving mid-way), and the launched steps are used."""
from __future__ import annotations

import pytest

from engine.decoding.engine import Engine
from engine.decoding.lookahead import Lookahead
from engine.decoding.sequence import Delta, Finished, Request
from engine.runtime.runner import ModelRunner
from tests.test_spec_generate import TinyTokenizer, tiny_loaded


def _run(lookahead: bool, monkeypatch, fused: bool = False, eos: int = -1, stop: str = "never"):
    loaded = tiny_loaded(scale=0.6)
    runner = ModelRunner(loaded, 96, num_slots=3, fast_decode=fused)
    engine = Engine(runner, TinyTokenizer(eos=eos), lookahead=lookahead)
    used = []
    real_take = Lookahead.take
    monkeypatch.setattr(Lookahead, "take", lambda self, rows, tokens: used.append(
        (out := real_take(self, rows, tokens)) is not None) or out)
    outputs: dict[str, list] = {}

    def request(name: str, prompt: list[int], **kw) -> Request:
        outputs[name] = []
        return Request(prompt, id=name, emit=lambda e: outputs[name].append(
            e.token_ids if isinstance(e, Delta) else ("end", e.reason) if isinstance(e, Finished) else e), **kw)

    reqs = [request("a", [5, 9, 2, 7], max_tokens=30, ignore_eos=True),
            request("b", [3, 3, 8], max_tokens=20, ignore_eos=True),
            request("c", [1, 2, 3, 4, 5, 6], max_tokens=40),  # ends at its end-of-sequence id
            ]
    late = request("d", [4, 4, 4], max_tokens=12, stop=(stop,), ignore_eos=True)  # ends at its stop string
    for r in reqs:
        engine.submit(r)
    steps = 0
    while engine.has_work and steps < 400:
        engine.step()
        steps += 1
        if steps == 14:
            reqs[0].cancelled.set()
        if steps == 10:
            engine.submit(late)
    caches = [list(s.tokens) for s in runner.cache.slots]
    return outputs, caches, used


@pytest.mark.parametrize("fused", [False, True])
def test_lookahead_changes_nothing_but_the_overlap(one_thread, monkeypatch, fused):
    free, _, _ = _run(False, monkeypatch, fused)  # what the requests say without an end-of-sequence id or stop
    c = [t for e in free["c"] if isinstance(e, list) for t in e]
    d = [t for e in free["d"] if isinstance(e, list) for t in e]
    eos = next(t for t in c[5:] if t not in c[:5])  # c ends after a few tokens
    stop = f"t{next(t for t in d[3:] if t not in d[:3])} "  # and d at a stop string
    want, want_cache, _ = _run(False, monkeypatch, fused, eos, stop)
    got, got_cache, used = _run(True, monkeypatch, fused, eos, stop)
    assert got == want
    assert got_cache == want_cache  # no slot keeps a token of a step dropped
    assert sum(used) >= 8 and not all(used)  # launched steps were taken, and some dropped
    assert want["b"][-1] == ("end", "length") and not any(e[0] == "end" for e in want["a"] if isinstance(e, tuple))
    assert want["c"][-1] == ("end", "stop") and want["d"][-1] == ("end", "stop")
