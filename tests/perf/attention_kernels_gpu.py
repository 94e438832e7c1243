"""GPU timing of the decode-attention and rope/cache-write kernels at real shapes (checks first, then times).

Usage: python tests/perf/attention_kernels_gpu.py [--reps 200]   (--smoke: tiny shapes, runs on a CPU too)
Each call is captured in a CUDA graph and replayed (as the decode step will run it); the time is the mean
of `reps` replays measured with CUDA events. Bandwidth counts the K and V bytes the rows must read
(2 * KV * seq_len * D * element size per row); torch's SDPA (flash / efficient kernels) on the same
keys is the in-run baseline. The quantized KV types (int8, int4, k8v4) are timed at the same shapes: the
bytes are those of their codes and scales (quant/kv_format.py), the error is against the reference
attention over the dequantized rows.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":  # a script: the interpreter is the only way these kernels run on a CPU (--smoke)
    os.environ["TRITON_INTERPRET"] = "1"

from engine.kernels.attention_decode import (_launch, block_size, decode_attention,  # noqa: E402
                                             decode_attention_reference, default_num_splits)
from engine.kernels.rope_cache import qk_norm_rope_write, qk_norm_rope_write_reference  # noqa: E402


def graph_time_us(fn, reps: int) -> float:
    """Mean microseconds of one replay of fn captured in a CUDA graph (wall clock of one call on a CPU)."""
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def attention_case(h, kv, d, cache_len, lens, splits_list, reps, dtype=torch.bfloat16):
    m = len(lens)
    k = torch.randn(1, kv, cache_len, d, device=DEVICE, dtype=dtype)  # [1, KV, S, D]
    v = torch.randn_like(k)
    q = torch.randn(m, h, d, device=DEVICE, dtype=dtype)  # [M, H, D]
    slot_ids = torch.zeros(m, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    scale = d ** -0.5
    want = decode_attention_reference(q, k, v, slot_ids, seq_lens, scale)
    nbytes = sum(2 * kv * n * d * k.element_size() for n in lens)
    label = f"H={h} KV={kv} D={d} cache={cache_len} lens={lens if m <= 2 else f'{m} rows from {lens[0]}'}"
    default = default_num_splits(cache_len, num_kv_heads=kv, batch=m, head_dim=d)
    for splits in sorted(set(splits_list) | {default}):
        for dot_f32 in (False, True) if DEVICE == "cuda" else (True,):
            def call():
                _launch(q, k, v, slot_ids, seq_lens, scale, splits, out, dot_f32=dot_f32, block_s=block_size(d))
            call()
            err = (out.float() - want.float()).abs().max().item()
            us = graph_time_us(call, reps)
            tag = " (default)" if splits == default else ""
            print(f"{label} splits={splits:4d}{tag} dot_f32={int(dot_f32)}: {us:8.2f} us  "
                  f"{nbytes / us / 1e3:7.0f} GB/s  max|err| {err:.1e}")
    if m == 1 and DEVICE == "cuda":
        n = lens[0]
        qs = q.view(1, h, 1, d)
        def sdpa():
            F.scaled_dot_product_attention(qs, k[:, :, :n], v[:, :, :n], enable_gqa=True)
        us = graph_time_us(sdpa, reps)
        print(f"{label} torch SDPA: {us:8.2f} us  {nbytes / us / 1e3:7.0f} GB/s")


def quantized_case(h, kv, d, cache_len, n, reps, kv_type):
    """Decode attention of one row over n keys of a (quantized) cache, dequantized in the kernel."""
    from engine.runtime.kv_cache import CacheBatch, KVCache, kv_type_of
    from engine.sources.model_config import ModelConfig
    from quant.kv_format import kv_bytes_per_token
    cfg = ModelConfig("qwen3", vocab_size=8, hidden_size=h * d, intermediate_size=8, num_layers=1, num_heads=h,
                      num_kv_heads=kv, head_dim=d)
    cache = KVCache(cfg, cache_len, 1, dtype=torch.bfloat16, device=DEVICE, kv_type=kv_type)
    rows = torch.randn(1, kv, cache_len, d, device=DEVICE, dtype=torch.bfloat16)  # [1, KV, S, D]
    cache.write(0, CacheBatch.make([0], [0], cache_len, DEVICE), rows, torch.randn_like(rows))
    q = torch.randn(1, h, d, device=DEVICE, dtype=torch.bfloat16)  # [1, H, D]
    slot_ids, lens = (torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([0], [n]))
    scales = cache.layer_read_args(0)
    splits = default_num_splits(cache_len, num_kv_heads=kv, head_dim=d)
    want = decode_attention_reference(q, cache.k[0], cache.v[0], slot_ids, lens, d ** -0.5, **scales)
    got = decode_attention(q, cache.k[0], cache.v[0], slot_ids, lens, d ** -0.5, splits, **scales)
    err = (got.float() - want.float()).abs().max().item()
    us = graph_time_us(lambda: decode_attention(q, cache.k[0], cache.v[0], slot_ids, lens, d ** -0.5, splits,
                                                **scales), reps)
    nbytes = n * kv_bytes_per_token(kv_type_of(kv_type), 1, kv, d)
    print(f"KV {kv_type:5} H={h} KV={kv} D={d} cache={cache_len} len={n} splits={splits}: {us:8.2f} us  "
          f"{nbytes / us / 1e3:7.0f} GB/s  max|err| {err:.1e}")


def prefill_case(h, kv, d, cached, chunk, reps, kv_type):
    """Attention of a `chunk`-token prefill chunk after `cached` rows (causal within the chunk): the prefill
    kernel reading the codes (engine/kernels/attention_prefill.py), against what the model did before it
    (KVCache.read dequantizing every row in use, then SDPA with a mask; for bf16: the rows as they are)."""
    from engine.kernels.attention_prefill import prefill_attention, prefill_attention_reference
    from engine.runtime.kv_cache import CacheBatch, KVCache
    from engine.runtime.model import attention
    from engine.sources.model_config import ModelConfig
    cfg = ModelConfig("qwen3", vocab_size=8, hidden_size=h * d, intermediate_size=8, num_layers=1, num_heads=h,
                      num_kv_heads=kv, head_dim=d)
    n = cached + chunk
    cache = KVCache(cfg, n, 1, dtype=torch.bfloat16, device=DEVICE, kv_type=kv_type)
    rows = torch.randn(1, kv, n, d, device=DEVICE, dtype=torch.bfloat16)  # [1, KV, S, D]
    cache.write(0, CacheBatch.make([0], [0], n, DEVICE), rows, torch.randn_like(rows))
    q = torch.randn(1, chunk, h, d, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)  # [1, H, T, D] as the model's
    batch = CacheBatch.make([0], [cached], chunk, DEVICE)
    args = (q, cache.k[0], cache.v[0], batch.slot_ids, batch.positions[:, 0], d ** -0.5)
    flops = 4 * h * d * (chunk * cached + chunk * (chunk + 1) // 2)  # q·k and p·v over the keys each query sees
    label = f"prefill {kv_type:5} H={h} KV={kv} D={d} chunk={chunk} after {cached}"
    scales = cache.layer_read_args(0)
    got = prefill_attention(*args, **scales)  # bf16 too: the kernel on a float cache, against SDPA below
    want = prefill_attention_reference(*args, **scales)
    err = (got.float() - want.float()).abs().max().item()
    us = graph_time_us(lambda: prefill_attention(*args, **scales), reps)
    print(f"{label} kernel: {us:9.1f} us  {flops / us / 1e6:6.1f} TFLOP/s  max|err| {err:.1e}")
    key_pos = torch.arange(n, device=DEVICE)
    mask = key_pos[None, None, None, :] <= batch.positions[:, None, :, None]  # [1, 1, T, S]

    def read_then_sdpa():
        keys, values = cache.read(0, batch, n)  # [1, KV, S, D] dequantized
        attention(q, keys, values, mask, False, h != kv)
    us = graph_time_us(read_then_sdpa, reps)
    print(f"{label} read + SDPA: {us:9.1f} us  {flops / us / 1e6:6.1f} TFLOP/s")


def rope_case(h, kv, d, m, reps, max_seq=32768):
    qkv = torch.randn(m, (h + 2 * kv) * d, device=DEVICE, dtype=torch.bfloat16)  # [M, (H + 2KV) * D]
    qw = torch.randn(d, device=DEVICE, dtype=torch.bfloat16)
    kw = torch.randn(d, device=DEVICE, dtype=torch.bfloat16)
    inv_freq = (1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64, device=DEVICE) / d)).float()
    positions = torch.randperm(max_seq, device=DEVICE)[:m]
    slot_ids = torch.zeros(m, dtype=torch.int32, device=DEVICE)
    k_cache = torch.zeros(1, kv, max_seq, d, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = qk_norm_rope_write(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, h, kv, d, qw, kw)
    q_ref = qk_norm_rope_write_reference(qkv, positions, slot_ids, inv_freq, k_ref, v_ref, h, kv, d, qw, kw)
    rel = ((q.float() - q_ref.float()).abs() / q_ref.float().abs().clamp(min=1e-2)).max().item()
    ulps = ((q.float() != q_ref.float()).float().mean().item())
    us = graph_time_us(lambda: qk_norm_rope_write(qkv, positions, slot_ids, inv_freq, k_cache, v_cache, h, kv, d,
                                                  qw, kw), reps)
    print(f"rope+norm+write H={h} KV={kv} D={d} M={m}: {us:6.2f} us  q max rel err {rel:.1e}, "
          f"{ulps:.1%} of q elements differ from the reference")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one rep: checks the script itself")
    args = parser.parse_args()
    if DEVICE == "cpu" and not args.smoke:
        parser.error("no CUDA GPU here: only --smoke runs on a CPU (under Triton's interpreter)")
    if args.smoke:
        print("smoke run: Triton's interpreter truncates float32 -> bfloat16 casts (a GPU rounds to nearest), "
              "so bf16 results differ by one ulp here; tests/test_kernels_attention.py corrects for it")
        attention_case(4, 2, 64, 300, [300], [1, 3], 1)
        attention_case(4, 2, 64, 300, [5, 299], [2], 1)
        for kv_type in ("int8", "int4", "k8v4"):
            quantized_case(4, 2, 64, 300, 299, 1, kv_type)
        rope_case(4, 2, 64, 3, 1, max_seq=64)
        for kv_type in ("bf16", "int8", "k8v4"):
            prefill_case(6, 2, 64, 40, 24, 1, kv_type)
        return
    print(torch.cuda.get_device_name(), "SMs:", torch.cuda.get_device_properties(0).multi_processor_count)
    for cache, n in ((4096, 4096), (32768, 32768), (32768, 4096), (32768, 512)):
        attention_case(32, 8, 128, cache, [n], [1, 4, 8, 16, 32, 64, 128, 256], args.reps)
    attention_case(40, 8, 128, 4096, [4096], [8, 16, 32], args.reps)
    attention_case(9, 3, 64, 4096, [4096], [4, 8, 16, 32], args.reps)
    attention_case(32, 8, 128, 4096, [4000, 4001, 4002, 4003], [4, 8, 16], args.reps)
    for cache, n in ((4096, 4096), (32768, 32768)):
        for kv_type in ("bf16", "int8", "int4", "k8v4"):
            quantized_case(32, 8, 128, cache, n, args.reps, kv_type)
    for m in (1, 16):
        rope_case(32, 8, 128, m, args.reps)
    for cached in (4096, 32768):
        for kv_type in ("bf16", "int8", "k8v4", "int4"):
            prefill_case(32, 8, 128, cached, 512, max(3, args.reps // 20), kv_type)


if __name__ == "__main__":
    main()
