"""The decode step launched ahead (engine.decoding.lookahead): on a GPU the next step runs while the host
turns the last one's tokens into events. Here on the CPU (asked for): outputs and every slot's cached tokens
equal to the engine without it, over batched requests that end in every way (end-of-sequence token, stop
string, max_tokens, cancelled mid-way, a request arriving mid-way), and the launched steps are used — with the
tokens fed on the device (the sampler's tensor, before the read-back) and from the host. A row that ends leaves
the launched step alone; the read-back waits for the tokens, not for what runs after them (GPU)."""
from __future__ import annotations

import pytest
import torch

from engine.decoding.engine import Engine
from engine.decoding.lookahead import Lookahead, TokenReadback
from engine.decoding.sequence import Delta, Finished, Request
from engine.runtime.kv_cache import KVSlot
from engine.runtime.runner import PENDING, ModelRunner
from tests.test_spec_generate import TinyTokenizer, tiny_loaded


def _run(lookahead: bool, monkeypatch, fused: bool = False, eos: int = -1, stop: str = "never", feed: str = "device"):
    monkeypatch.setenv("BONSAI_TOKEN_FEED", feed)
    loaded = tiny_loaded(scale=0.6)
    runner = ModelRunner(loaded, 96, num_slots=3, fast_decode=fused)
    engine = Engine(runner, TinyTokenizer(eos=eos), lookahead=lookahead)
    assert engine.feed_ahead == (lookahead and feed == "device")
    used, fed_kinds = [], set()
    real_take, real_launch = Lookahead.take, Lookahead.launch
    monkeypatch.setattr(Lookahead, "take", lambda self, rows, tokens: used.append(
        (out := real_take(self, rows, tokens)) is not None) or out)
    monkeypatch.setattr(Lookahead, "launch", lambda self, rows, tokens: fed_kinds.add(type(tokens)) or real_launch(
        self, rows, tokens))
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
    assert all(type(t) is int for c in caches for t in c)  # values read back, never a tensor or PENDING left
    assert fed_kinds <= {torch.Tensor if engine.feed_ahead else list}
    return outputs, caches, used


@pytest.mark.parametrize("feed", ["device", "host"])
@pytest.mark.parametrize("fused", [False, True])
def test_lookahead_changes_nothing_but_the_overlap(one_thread, monkeypatch, fused, feed):
    free, _, _ = _run(False, monkeypatch, fused)  # what the requests say without an end-of-sequence id or stop
    c = [t for e in free["c"] if isinstance(e, list) for t in e]
    d = [t for e in free["d"] if isinstance(e, list) for t in e]
    eos = next(t for t in c[5:] if t not in c[:5])  # c ends after a few tokens
    stop = f"t{next(t for t in d[3:] if t not in d[:3])} "  # and d at a stop string
    want, want_cache, _ = _run(False, monkeypatch, fused, eos, stop)
    got, got_cache, used = _run(True, monkeypatch, fused, eos, stop, feed)
    assert got == want
    assert got_cache == want_cache  # no slot keeps a token of a step dropped
    assert sum(used) >= 8 and not all(used)  # launched steps were taken, and some dropped
    assert want["b"][-1] == ("end", "length") and not any(e[0] == "end" for e in want["a"] if isinstance(e, tuple))
    assert want["c"][-1] == ("end", "stop") and want["d"][-1] == ("end", "stop")


class _Runner:
    """What Lookahead uses of a runner: slots, and decode_batch appending what it fed (PENDING for device tokens)."""
    def __init__(self, slots: int, vocab: int = 11):
        self.slots, self.vocab, self.calls = [KVSlot(i, 64, [1, 2]) for i in range(slots)], vocab, 0
        self.device, self.takes_device_tokens = torch.device("cpu"), True

    def slot(self, i: int) -> KVSlot:
        return self.slots[i]

    def decode_batch(self, slots: list[KVSlot], tokens) -> torch.Tensor:
        self.calls += 1
        held = [PENDING] * len(tokens) if isinstance(tokens, torch.Tensor) else list(tokens)
        for s, t in zip(slots, held):
            s.tokens.append(t)
        return torch.arange(len(slots) * self.vocab, dtype=torch.float32).view(len(slots), self.vocab)  # [B, V]


def test_device_tokens_are_settled_into_the_slots_and_a_row_that_ends_leaves_alone():
    runner = _Runner(4)
    ahead = Lookahead(runner)
    assert ahead.on_device
    ahead.launch([0, 2, 3], torch.tensor([7, 8, 9]))
    assert [s.tokens[-1] for s in runner.slots] == [PENDING, 2, PENDING, PENDING] and ahead.tokens is None
    ahead.settle([7, 8, 9])
    assert [s.tokens for s in runner.slots] == [[1, 2, 7], [1, 2], [1, 2, 8], [1, 2, 9]]
    logits = ahead.logits.clone()  # [3, V]
    ahead.drop(2)  # its request ended (its end-of-sequence token): it forgets the token it fed
    assert runner.slots[2].tokens == [1, 2] and ahead.rows == [0, 3]
    ahead.drop(1)  # not in the step: nothing
    got = ahead.take([0, 3], [7, 9])
    assert torch.equal(got, logits[[0, 2]]) and not ahead.rows and runner.calls == 1
    assert [s.tokens for s in runner.slots] == [[1, 2, 7], [1, 2], [1, 2], [1, 2, 9]]


def test_a_step_that_is_not_the_next_one_is_dropped_whole():
    runner = _Runner(3)
    ahead = Lookahead(runner)
    ahead.launch([0, 1], [4, 5])
    assert ahead.take([0, 1], [4, 6]) is None  # row 1 was forced another token
    assert [s.tokens for s in runner.slots] == [[1, 2]] * 3 and not ahead.rows
    ahead.launch([0, 1], [4, 5])
    ahead.drop(0)
    ahead.drop(1)
    assert ahead.logits is None and ahead.take([0, 1], [4, 5]) is None
    assert [s.tokens for s in runner.slots] == [[1, 2]] * 3


def test_token_feed_host_launches_after_the_read_back(monkeypatch):
    monkeypatch.setenv("BONSAI_TOKEN_FEED", "host")
    assert not Lookahead(_Runner(1)).on_device
    runner = _Runner(1)
    runner.takes_device_tokens = False  # a host embedding table (engine.memory.host_embedding)
    monkeypatch.delenv("BONSAI_TOKEN_FEED")
    assert not Lookahead(runner).on_device and Lookahead(_Runner(1)).on_device


def test_token_readback_on_the_cpu():
    back = TokenReadback(torch.device("cpu"))
    back.start(torch.tensor([3, 1, 4]))
    assert back.wait() == [3, 1, 4]
    with pytest.raises(AssertionError):
        back.wait()


@pytest.mark.gpu
def test_token_readback_reads_the_tokens_with_work_queued_after_them():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    back = TokenReadback(torch.device("cuda"))
    for n in (1, 5, 40):  # the pinned buffer grows
        logits = torch.randn(n, 1000, device="cuda")  # [B, V]
        chosen = logits.argmax(dim=-1)  # [B]
        back.start(chosen)
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # queued behind the copy: ~tens of ms the read-back does not wait for
            a = a @ a / 64
        assert back.wait() == chosen.tolist()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["tri", "bf16"])
def test_on_a_gpu_tokens_fed_on_the_device_change_nothing(monkeypatch, weights):
    """The graphed decode step on CUDA, lookahead on (its default there): greedy and seeded sampled requests batched,
    ending by length and end-of-sequence id, give the same tokens with the tokens fed on the device as from the host."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.decoding.sampling import SamplingParams
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    from tests.test_decode_step import CFG

    def run(feed: str) -> dict:
        monkeypatch.setenv("BONSAI_TOKEN_FEED", feed)
        loaded = load_dummy(CFG, "tiny", device="cuda", weight_format=WeightFormat(weights, 64, "int4"),
                            dtype=torch.float32)
        runner = ModelRunner(loaded, 128, num_slots=3)
        engine = Engine(runner, TinyTokenizer(eos=7))
        assert engine.ahead is not None and engine.feed_ahead == (feed == "device")
        out: dict[str, list] = {}
        for name, prompt, sampling in (("g", [5, 9, 2], SamplingParams()), ("s", [3, 3, 8, 1], SamplingParams(
                temperature=0.9, top_p=0.95, seed=11)), ("e", [1, 2, 3], SamplingParams(temperature=1.5, seed=3))):
            out[name] = []
            engine.submit(Request(prompt, id=name, max_tokens=40, ignore_eos=name != "e", sampling=sampling,
                                  emit=lambda e, n=name: out[n].extend(e.token_ids) if isinstance(e, Delta) else None))
        for _ in range(300):
            if not engine.has_work:
                break
            engine.step()
        return out

    host, device = run("host"), run("device")
    assert device == host and len(host["g"]) == 40 and len(host["s"]) == 40
