"""KV offload and weight offload against the resident runner, on the CPU (the same code path as on a
GPU: "host" and "device" tensors are both CPU tensors). The side-stream copies run either at once or
deferred until the compute side waits for them (engine.memory.host_copies): the first catches a buffer
overwritten while still in use, the second a missing wait."""
from __future__ import annotations

import dataclasses
import gc
import logging
from pathlib import Path

import pytest
import torch

from engine.errors import BonsaiError
from engine.memory.host_copies import CopyStream, HostAllocator
from engine.runtime.kv_cache import KVCache
from engine.memory.kv_offload import OffloadedKVCache
from engine.weights.loader import LoadedModel, TensorSummary
from engine.runtime.runner import ModelRunner
from engine.memory.weight_offload import bytes_per_layer, embedding_bytes
from tests.test_kv_cache import TINY, tiny_model

CFG = dataclasses.replace(TINY, num_layers=3)  # more layers than GPU buffers: the ring is exercised
SEQ = 40
PROMPTS = ([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43, 38, 32, 79, 50])


def make_runner(fast_decode: bool = False, num_slots: int = 1, kv_offload: bool = False,
                offload_layers=None, deferred: bool = False, kv_type: str = "bf16", cfg=CFG) -> ModelRunner:
    loaded = LoadedModel(model=tiny_model(cfg), tokenizer=None, config=cfg, path=Path("tiny"),
                         summary=TensorSummary("test", 0, 0, 0), device=torch.device("cpu"),
                         dtype=torch.float32, weight_dtype=torch.float32)
    runner = ModelRunner(loaded, max_seq_len=SEQ, num_slots=num_slots, prefill_chunk_size=4, fast_decode=False,
                         kv_offload=kv_offload, offload_layers=offload_layers, kv_type=kv_type)
    if kv_offload and deferred:
        runner.cache = OffloadedKVCache(cfg, SEQ, num_slots, device="cpu", deferred_copies=True)
    if runner.weight_stream is not None and deferred:
        runner.weight_stream.copies = CopyStream(torch.device("cpu"), deferred=True)
    if fast_decode:  # the fused decode step (reference kernels on the CPU), after the cache is final
        runner.decoder = runner._make_decoder()
    return runner


def scenario(runner: ModelRunner, two_slots: bool) -> tuple[list[int], list[torch.Tensor]]:
    """Chunked prefill, greedy decode, a verify pass of 3 rows with 2 rejected (rewind), and with two
    slots batched decode at different lengths. Returns the greedy tokens and every logits row."""
    tokens, logits = [], []

    def keep(x: torch.Tensor) -> int:
        logits.append(x.clone())
        return int(x.reshape(-1, x.shape[-1])[-1].argmax())

    a = runner.slot(0)
    nxt = keep(runner.prefill(a, list(PROMPTS[0])))
    for _ in range(4):
        tokens.append(nxt)
        nxt = keep(runner.forward(a, [nxt]))
    rows, _ = runner.verify(a, [nxt, 7, 11])
    keep(rows)
    a.rewind(2)
    tokens.append(nxt)
    nxt = keep(runner.forward(a, [int(rows[0].argmax())]))
    if two_slots:
        b = runner.slot(1)
        other = keep(runner.prefill(b, list(PROMPTS[1])))
        for _ in range(4):
            out = runner.decode_batch([a, b], [nxt, other])  # [2, V]
            keep(out)
            nxt, other = int(out[0].argmax()), int(out[1].argmax())
            tokens += [nxt, other]
    return tokens, logits


@pytest.mark.parametrize("fast_decode", [False, True])
@pytest.mark.parametrize("two_slots", [False, True])
@pytest.mark.parametrize("deferred", [False, True])
def test_kv_offload_matches_resident(one_thread, fast_decode, two_slots, deferred):
    slots = 2 if two_slots else 1
    want_tokens, want = scenario(make_runner(fast_decode, slots), two_slots)
    runner = make_runner(fast_decode, slots, kv_offload=True, deferred=deferred)
    got_tokens, got = scenario(runner, two_slots)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # the host pool holds every slot's rows (the last pass's rows are written back on synchronize)
    runner.cache.synchronize()
    resident = make_runner(fast_decode, slots)
    scenario(resident, two_slots)
    for slot in runner.cache.slots:
        n = slot.length
        for name in ("k", "v"):
            torch.testing.assert_close(runner.cache.tensors[name][:, slot.index, :, :n],
                                       resident.cache.tensors[name][:, slot.index, :, :n], atol=1e-5, rtol=1e-5)


def test_kv_offload_copies_only_the_positions_in_use(one_thread):
    cache = OffloadedKVCache(TINY, SEQ, 2, deferred_copies=False)
    copied = []
    cache.copies.copy = lambda dst, src: copied.append((tuple(dst.shape), tuple(src.shape)))
    cache.begin_pass([1], [9], [12])  # slot 1 holds 9 positions, the pass writes 3 more
    for i in range(TINY.num_layers):
        cache.layer(i)
    cache.synchronize()
    row = (TINY.num_kv_heads, TINY.head_dim)
    loads = [c for c in copied if c[0] == (9, *row)]
    saves = [c for c in copied if c[0] == (3, *row)]
    assert len(loads) == len(saves) == 2 * TINY.num_layers and len(copied) == 4 * TINY.num_layers


def test_host_kv_budget_too_small_is_one_line():
    need = KVCache(TINY, SEQ, 2, device="meta").nbytes
    with pytest.raises(BonsaiError, match=r"needs 1 MiB .* grants 0: raise host_kv_mib") as e:
        OffloadedKVCache(TINY, SEQ, 2, host_bytes=need - 1)
    assert "\n" not in str(e.value)
    assert OffloadedKVCache(TINY, SEQ, 2, host_bytes=need).nbytes == need


def test_pinned_regions_are_page_aligned_and_exact():
    registered = []
    alloc = HostAllocator(pin=True, what="test pool", register=lambda ptr, n: registered.append((ptr, n)) or 0)
    t = alloc.empty((3, 5, 7), torch.float16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float16 and t.is_contiguous() and not t.any()
    (ptr, n), = registered
    assert ptr == t.data_ptr() and ptr % alloc.PAGE == 0 and n == alloc.PAGE  # 210 bytes: one page
    # the storage itself starts at the registered page (torch's is_pinned asks about a storage's first
    # byte: a view into a larger allocation would read as not pinned, and a graph would not capture it)
    assert t.untyped_storage().data_ptr() == ptr
    view = t[1:].view(torch.int16)  # outlives the tensor: the memory stays valid
    t.fill_(1.5)
    del t
    gc.collect()
    assert view.view(torch.float16).eq(1.5).all()


def test_pinning_failure_falls_back_to_pageable_with_one_warning(caplog):
    alloc = HostAllocator(pin=True, what="test pool", register=lambda ptr, n: 2)  # cudaErrorMemoryAllocation

    def no_pinned_memory(shape, dtype):
        raise RuntimeError("out of pinned memory")

    alloc._torch_pinned = no_pinned_memory
    with caplog.at_level(logging.WARNING, logger="engine.memory.host_copies"):
        tensors = [alloc.empty((4, 8), torch.float16) for _ in range(3)]
    assert all(t.shape == (4, 8) and not t.any() for t in tensors) and not alloc.pinned_all
    assert len([r for r in caplog.records if "could not pin" in r.message]) == 1


@pytest.mark.parametrize("fast_decode", [False, True])
def test_kv_offload_of_a_quantized_cache_matches_resident(one_thread, fast_decode):
    """Codes and their scale tensors stream like any other rows (int8; the tiny head_dim 16 is too
    small for int4 groups of 32)."""
    want_tokens, want = scenario(make_runner(fast_decode, 2, kv_type="int8"), True)
    runner = make_runner(fast_decode, 2, kv_offload=True, kv_type="int8")
    assert {"k_scale", "v_scale"} <= set(runner.cache.tensors)
    got_tokens, got = scenario(runner, True)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fast_decode", [False, True])
@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("layers", [{1}, {0, 2}, {0, 1, 2}])
def test_weight_offload_matches_resident(one_thread, fast_decode, deferred, layers):
    want_tokens, want = scenario(make_runner(fast_decode, 2), True)
    runner = make_runner(fast_decode, 2, offload_layers=layers, deferred=deferred)
    assert type(runner.model.embed).__name__ == "HostEmbedding"
    got_tokens, got = scenario(runner, True)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        assert torch.equal(g, w)  # the same weights, copied: bit-identical


@pytest.mark.parametrize("fast_decode", [False, True])
def test_weight_and_kv_offload_together(one_thread, fast_decode):
    want_tokens, want = scenario(make_runner(fast_decode, 2), True)
    got_tokens, got = scenario(make_runner(fast_decode, 2, kv_offload=True, offload_layers={0, 1, 2},
                                           deferred=True), True)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_bytes_per_layer_by_hand():
    model = tiny_model()
    h, f, q, kv, d = TINY.hidden_size, TINY.intermediate_size, TINY.q_size, TINY.kv_size, TINY.head_dim
    floats = h * (q + 2 * kv) + q * h + h * 2 * f + f * h + 2 * h + 2 * d  # matrices, two norms, q/k norms
    assert bytes_per_layer(model) == [4 * floats] * TINY.num_layers
    assert embedding_bytes(model) == 4 * TINY.vocab_size * h
    with torch.device("meta"):
        from engine.runtime.model import Transformer
        meta = Transformer(TINY)
    assert bytes_per_layer(meta) == bytes_per_layer(model)


def test_triton_kernels_read_and_write_the_streamed_buffers(one_thread):
    """The fused step's Triton kernels (interpreted on the CPU) take the ring buffers' strides."""
    from engine.runtime.cuda_graphs import DecodeStepRunner
    got = []
    for kv_offload in (False, True):
        runner = make_runner(kv_offload=kv_offload, deferred=True)
        slot = runner.slot(0)
        runner.prefill(slot, list(PROMPTS[0]))
        step = DecodeStepRunner(runner.model, runner.cache, rows=2, num_splits=2, kernels=True)
        rows = []
        for token in (5, 9):  # two rows per step: a verify pass of two tokens, one of them kept
            rows.append(step.run([token, 7], [slot.length, slot.length + 1], [0, 0]).clone())
            slot.tokens.append(token)
        got.append(torch.stack(rows))
    torch.testing.assert_close(got[1], got[0], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_greedy_tokens_with_offload(smollm2_gguf):
    """The real model: KV offload, then KV + weight offload of every block, give plain decoding's tokens."""
    from engine.weights.loader import load_model
    loaded = load_model(smollm2_gguf)
    prompt = loaded.tokenizer.encode("The three primary colors are", add_special_tokens=True)

    def greedy(**offload) -> list[int]:
        runner = ModelRunner(loaded, max_seq_len=48, prefill_chunk_size=4, **offload)
        slot = runner.slot(0)
        tokens = [int(runner.prefill(slot, prompt).argmax())]
        for _ in range(7):
            tokens.append(int(runner.forward(slot, tokens[-1:])[-1].argmax()))
        return tokens

    want = greedy()
    assert greedy(kv_offload=True) == want
    layers = range(loaded.config.num_layers)  # last: weight offload rebinds the model's blocks
    assert greedy(kv_offload=True, offload_layers=layers) == want


@pytest.mark.parametrize("deferred", [False, True])
def test_serial_copies_match_resident(one_thread, deferred):
    """overlap off (each layer copied just before its use: what tests/perf/gpu_offload.py compares with)."""
    want_tokens, want = scenario(make_runner(False, 2), True)
    runner = make_runner(False, 2, kv_offload=True, offload_layers={0, 2}, deferred=deferred)
    runner.cache.overlap = runner.weight_stream.overlap = False
    got_tokens, got = scenario(runner, True)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


class _ReplayOnCPU:
    """What replaying a captured streamed decode step does, on the CPU: the pass runs from the state the
    capture assumed (engine.memory.weight_offload.WeightStreamer.prepare_capture, without its synchronize,
    so a missing wait before the replay still reads stale data), then its copies are joined."""

    def __init__(self, step):
        self.step = step

    def replay(self) -> None:
        stream = self.step.weight_stream
        stream.replay_entry()  # a graph waits on no event from outside it
        self.step.logits = self.step._eager()
        stream.join()


# one, three (no wrap), two and four (the passes wrap; with four each buffer holds two blocks in turn) streamed
@pytest.mark.parametrize("layers", [{1}, {0, 2}, {0, 1, 2}, {0, 1, 3, 4}])
def test_graphed_streamed_steps_match_resident(one_thread, monkeypatch, layers):
    """The replay protocol of a graphed streamed step (before_replay, the captured pass, join, after_replay),
    with eager prefill chunks, verify rows and batched decode between replays: outputs equal resident ones."""
    from engine.runtime import cuda_graphs
    cfg = dataclasses.replace(TINY, num_layers=5)
    want_tokens, want = scenario(make_runner(True, 2, cfg=cfg), True)
    init = cuda_graphs.DecodeStepRunner.__init__

    def with_replay(self, *args, **kwargs):
        init(self, *args, **kwargs)
        assert self.graph is None  # no CUDA here: the step would run eagerly
        self.graph = _ReplayOnCPU(self)
        self.weight_stream.prepare_capture()  # what a capture leaves: nothing known to be loaded
        self.weight_stream.end_capture()

    monkeypatch.setattr(cuda_graphs.DecodeStepRunner, "__init__", with_replay)
    runner = make_runner(True, 2, offload_layers=layers, deferred=True, cfg=cfg)
    assert runner.weight_stream.wraps == (len(layers) % 2 == 0)
    got_tokens, got = scenario(runner, True)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layers", [{0, 2, 3}, {0, 1, 3, 4}])  # odd: the graph loads the first block; even: wraps
def test_graphed_streamed_decode_on_cuda_matches_resident(layers):
    """On a GPU the streamed fused step is captured with its copies (pinned host memory) and gives the
    resident graphed step's logits bit for bit, with eager prefill chunks and verify widths in between."""
    from engine.runtime.model import rotary_inverse_frequencies
    cfg = dataclasses.replace(TINY, num_layers=5)

    def runner(offload) -> ModelRunner:
        torch.manual_seed(0)
        model = tiny_model(cfg).to("cuda", torch.bfloat16)
        model.inv_freq = rotary_inverse_frequencies(cfg).cuda()
        loaded = LoadedModel(model=model, tokenizer=None, config=cfg, path=Path("tiny"),
                             summary=TensorSummary("test", 0, 0, 0), device=torch.device("cuda"),
                             dtype=torch.bfloat16, weight_dtype=torch.bfloat16)
        # prompts as eager chunks in both (a streamed run never takes the graphed 16-row prompt path)
        return ModelRunner(loaded, max_seq_len=SEQ, num_slots=2, prefill_chunk_size=4, offload_layers=offload,
                           prefill_graphs=False)

    want_tokens, want = scenario(runner(None), True)
    streamed = runner(layers)
    assert all(t.is_pinned() for t in streamed.weight_stream.host)  # registered pages torch sees as pinned
    assert streamed.weight_stream.graphable and streamed.decoder.graph is not None
    got_tokens, got = scenario(streamed, True)
    assert got_tokens == want_tokens
    for g, w in zip(got, want):
        assert torch.equal(g, w)
