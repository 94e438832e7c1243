"""The DeltaNet decode kernels (engine/kernels/deltanet_decode.py) vs their plain-torch references, and the
references vs the model's own maths (engine.runtime.deltanet). Without CUDA the kernels run under Triton's
interpreter on the CPU (TRITON_INTERPRET is set before the kernel module is imported); the `gpu` test adds
the Qwen3.6-27B shapes."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from engine.kernels import UnsupportedKernelShape  # noqa: E402
from engine.kernels.deltanet_decode import (conv_update, conv_update_reference, recurrent_update,  # noqa: E402
                                            recurrent_update_reference)
from engine.runtime.deltanet import _gated_norm, causal_conv, recurrent_gated_delta_rule  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _conv_inputs(m, c, k, slots, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, c, generator=gen).to(DEVICE)
    window = torch.randn(slots, c, k - 1, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(c, k, generator=gen).to(DEVICE, dtype)
    slot_ids = torch.tensor([slots - 1 - i for i in range(m)], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([0 if i == 1 else 5 + i for i in range(m)], dtype=torch.int32, device=DEVICE)
    return x, window, weight, slot_ids, positions


@pytest.mark.parametrize("m, c, dtype", [(1, 40, torch.float32), (3, 300, torch.bfloat16)])
def test_conv_update_matches_its_reference(m, c, dtype):
    x, window, weight, slot_ids, positions = _conv_inputs(m, c, 4, 4, dtype)
    w_ref = window.clone()
    ref = conv_update_reference(x, w_ref, weight, slot_ids, positions)
    got = conv_update(x, window, weight, slot_ids, positions)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(window, w_ref, atol=tol, rtol=tol)  # windows shifted in place, other slots kept


def test_conv_reference_is_the_models_causal_conv():
    x, window, weight, slot_ids, positions = _conv_inputs(2, 24, 4, 3, torch.float32)
    positions.fill_(3)
    before = window.clone()
    got = conv_update_reference(x, window, weight, slot_ids, positions)
    rows = slot_ids.long()
    out, seen = causal_conv(x[:, :, None], before[rows], weight)  # [M, C, 1], [M, C, K]
    torch.testing.assert_close(got, out[:, :, 0])
    torch.testing.assert_close(window[rows], seen[:, :, 1:])


def _recurrent_inputs(m, hk, hv, dk, dv, slots, seed=0):
    """q, k, v, a, b, A_log, dt_bias, z, norm_weight, eps, state, slot_ids, positions (recurrent_update's order)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(m, hk, dk, generator=gen).to(DEVICE) for _ in range(2))
    v, z = (torch.randn(m, hv, dv, generator=gen).to(DEVICE) for _ in range(2))
    a, b = (torch.randn(m, hv, generator=gen).to(DEVICE) * 3 for _ in range(2))
    a[0, 0] = 30.0  # softplus's linear branch
    a_log, dt_bias = (torch.randn(hv, generator=gen).to(DEVICE) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(dv, generator=gen)).to(DEVICE)
    state = torch.randn(slots, hv, dk, dv, generator=gen).to(DEVICE) * 0.1
    slot_ids = torch.tensor([(2 * i + 1) % slots for i in range(m)], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([0 if i == 0 else 9 for i in range(m)], dtype=torch.int32, device=DEVICE)
    return [q, k, v, a, b, a_log, dt_bias, z, norm_weight, 1e-6, state, slot_ids, positions]


def _with_state(args, state):
    return args[:10] + [state] + args[11:]


@pytest.mark.parametrize("m, hk, hv, dk, dv", [(1, 2, 4, 16, 16), (3, 1, 2, 32, 48), (2, 2, 2, 128, 64)])
def test_recurrent_update_matches_its_reference(m, hk, hv, dk, dv):
    args = _recurrent_inputs(m, hk, hv, dk, dv, slots=2 * m + 1)
    s_ref = args[10].clone()
    ref = recurrent_update_reference(*_with_state(args, s_ref))
    got = recurrent_update(*args)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(args[10], s_ref, atol=1e-5, rtol=1e-4)


def test_recurrent_reference_continues_the_models_layer_maths():
    """Two tokens through the reference, one step each, equal the model's gates, recurrence over both and
    gated RMSNorm (engine.runtime.deltanet)."""
    q, k, v, a, b, a_log, dt_bias, z, w, eps, state, _, _ = _recurrent_inputs(2, 2, 4, 16, 16, slots=1)
    start = state.clone()
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    outs = [recurrent_update_reference(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], a_log, dt_bias,
                                       z[t:t + 1], w, eps, state, one, one + 4) for t in range(2)]
    beta = b.sigmoid()
    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    ref, s, _ = recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], start)
    torch.testing.assert_close(torch.cat(outs), _gated_norm(ref[0], z, w, eps))
    torch.testing.assert_close(state, s)


# rows of one step in runs (a verify): slot 2 at positions 5-7, slot 0 at 0 (a fresh start), slot 1 at 3-4;
# the state after each row but a run's last kept at these buffer entries (-1: not kept)
RUN_SLOTS, RUN_POSITIONS = [2, 2, 2, 0, 1, 1], [5, 6, 7, 0, 3, 4]
RUN_LEN, SNAP_IDX = [3, 0, 0, 1, 2, 0], [1, 2, -1, -1, 4, -1]


def _runs():
    return (torch.tensor(RUN_SLOTS, dtype=torch.int32, device=DEVICE),
            torch.tensor(RUN_POSITIONS, dtype=torch.int32, device=DEVICE),
            torch.tensor(RUN_LEN, dtype=torch.int32, device=DEVICE), torch.tensor(SNAP_IDX, dtype=torch.int32,
                                                                                    device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_runs_step_a_slots_rows_in_order_and_keep_each_window(dtype):
    x, window, weight, _, _ = _conv_inputs(6, 300, 4, 3, dtype)
    slot_ids, positions, run_len, snap_idx = _runs()
    w_one, w_ref = window.clone(), window.clone()
    one = torch.cat([conv_update_reference(x[r:r + 1], w_one, weight, slot_ids[r:r + 1], positions[r:r + 1])
                     for r in range(6)])  # six one-row steps
    snap_ref = torch.zeros(5, 300, 3, dtype=dtype, device=DEVICE)
    ref = conv_update_reference(x, w_ref, weight, slot_ids, positions, run_len=run_len, snap_idx=snap_idx, snap=snap_ref)
    torch.testing.assert_close(ref, one)
    torch.testing.assert_close(w_ref, w_one)
    snap = torch.zeros_like(snap_ref)
    got = conv_update(x, window, weight, slot_ids, positions, run_len=run_len, snap_idx=snap_idx, snap=snap)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(window, w_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(snap, snap_ref, atol=tol, rtol=tol)
    assert snap[[0, 3]].abs().max() == 0  # entries no row named stay as they were


def test_recurrent_runs_step_a_slots_rows_in_order_and_keep_each_state():
    args = _recurrent_inputs(6, 2, 4, 32, 16, slots=3)
    slot_ids, positions, run_len, snap_idx = _runs()
    args[11], args[12] = slot_ids, positions
    s_one, s_ref = args[10].clone(), args[10].clone()
    one = torch.cat([recurrent_update_reference(*[t[r:r + 1] for t in args[:5]], *args[5:7], args[7][r:r + 1],
                                                *args[8:10], s_one, slot_ids[r:r + 1], positions[r:r + 1])
                     for r in range(6)])  # six one-row steps
    snap_ref = torch.zeros(5, 4, 32, 16, device=DEVICE)
    ref = recurrent_update_reference(*_with_state(args, s_ref), run_len=run_len, snap_idx=snap_idx, snap=snap_ref)
    torch.testing.assert_close(ref, one)
    torch.testing.assert_close(s_ref, s_one)
    snap = torch.zeros_like(snap_ref)
    got = recurrent_update(*args, run_len=run_len, snap_idx=snap_idx, snap=snap)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(args[10], s_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(snap, snap_ref, atol=1e-5, rtol=1e-4)
    assert snap[[0, 3]].abs().max() == 0


def test_bad_shapes_are_refused():
    args = _recurrent_inputs(1, 2, 4, 16, 16, slots=2)
    with pytest.raises(UnsupportedKernelShape, match="state"):
        recurrent_update(*_with_state(args, args[10].double()))
    x, window, weight, slot_ids, positions = _conv_inputs(1, 8, 4, 2, torch.float32)
    with pytest.raises(UnsupportedKernelShape, match="window"):
        conv_update(x, window[:, :4], weight, slot_ids, positions)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_27b_shapes_on_the_gpu():
    """Qwen3.6-27B: 16 key / 48 value heads of 128, conv channels 2·2048 + 6144; 4 rows of 8 slots."""
    args = _recurrent_inputs(4, 16, 48, 128, 128, slots=8)
    s_ref = args[10].clone()
    ref = recurrent_update_reference(*_with_state(args, s_ref))
    torch.testing.assert_close(recurrent_update(*args), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(args[10], s_ref, atol=1e-4, rtol=1e-4)
    x, window, weight, slot_ids, positions = _conv_inputs(4, 10240, 4, 8, torch.bfloat16)
    w_ref = window.clone()
    ref = conv_update_reference(x, w_ref, weight, slot_ids, positions)
    torch.testing.assert_close(conv_update(x, window, weight, slot_ids, positions), ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(window, w_ref)
    test_gated_rope_write_matches_its_reference_and_the_models_projection(torch.bfloat16, 24, 4, 256, 32)


@pytest.mark.parametrize("dtype, heads, kv_heads, d, half", [(torch.float32, 4, 2, 64, 8),
                                                             (torch.bfloat16, 3, 1, 32, 16), (torch.float32, 2, 2, 16, 2)])
def test_gated_rope_write_matches_its_reference_and_the_models_projection(dtype, heads, kv_heads, d, half):
    from engine.kernels.gated_rope import gated_rope_write, gated_rope_write_reference
    from engine.runtime.model import RMSNorm, apply_rotary
    gen = torch.Generator().manual_seed(d)
    m, slots, seq = 3, 4, 8
    qkv = torch.randn(m, 2 * (heads + kv_heads) * d, generator=gen).to(DEVICE)
    positions = torch.tensor([0, 5, 7], dtype=torch.int32, device=DEVICE)
    slot_ids = torch.tensor([3, 0, 1], dtype=torch.int32, device=DEVICE)
    inv_freq = (1.0 / 1e4 ** (torch.arange(half, dtype=torch.float32) / half)).to(DEVICE)
    qn, kn = ((1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype) for _ in range(2))
    caches = [torch.zeros(slots, kv_heads, seq, d, dtype=dtype, device=DEVICE) for _ in range(4)]
    args = (positions, slot_ids, inv_freq, qn, kn)
    ref = gated_rope_write_reference(qkv, *args, caches[0], caches[1], heads, kv_heads, d, 1e-6)
    got = gated_rope_write(qkv, *args, caches[2], caches[3], heads, kv_heads, d, 1e-6)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(caches[2], caches[0], **tol)
    torch.testing.assert_close(caches[3], caches[1], **tol)
    # the reference is the eager path's projection maths (RMSNorm modules, then the partial rotary)
    norm = RMSNorm(d, 1e-6).to(DEVICE, dtype)
    norm.weight.data.copy_(qn)
    q = qkv[:, :2 * heads * d].view(m, heads, 2 * d)[..., :d].to(dtype)
    angles = positions[:, None].float() * inv_freq
    want = apply_rotary(norm(q)[:, None], angles.cos()[:, None, None], angles.sin()[:, None, None])[:, 0]
    torch.testing.assert_close(ref, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kv_type", ["bf16", "int8", "k8v4", "int4"])
def test_graphed_hybrid_step_matches_the_cpu_eager_path_on_generated_weights(kv_type):
    """A tiny generated hybrid (float32, no transformers needed): the CUDA-graphed fused step against the CPU's
    eager model path on the same weights, two slots decoded together, on each KV type (a quantized cache: the
    CPU's key offsets, so both quantize the same rows)."""
    import dataclasses

    from engine.runtime.runner import ModelRunner
    from engine.sources.hybrid_config import HybridConfig
    from engine.sources.model_config import ModelConfig
    from engine.weights.loader import load_dummy
    hc = HybridConfig(("linear_attention",) * 3 + ("full_attention",), 2, 4, 64, 64)
    cfg = ModelConfig(architecture="qwen35", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=128, qk_norm=True, max_position_embeddings=256, hybrid=hc)
    loaded = load_dummy(cfg, "tiny", "cpu", dtype=torch.float32)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            gen = torch.Generator().manual_seed(len(name))
            p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else torch.randn(p.shape, generator=gen)
                    * (0.5 if name.endswith("conv_weight") else p.shape[-1] ** -0.5))
    gpu_loaded = dataclasses.replace(loaded, model=loaded.model.to("cuda"), device=torch.device("cuda"))
    cpu_loaded = load_dummy(cfg, "tiny", "cpu", dtype=torch.float32)
    cpu_loaded.model.load_state_dict({k: v.cpu() for k, v in gpu_loaded.model.state_dict().items()})
    cpu = ModelRunner(cpu_loaded, 64, 2, 8, fast_decode=False, kv_type=kv_type)
    gpu = ModelRunner(gpu_loaded, 64, 2, 8, kv_type=kv_type)
    assert gpu.decoder is not None and gpu.decoder.graph is not None
    if kv_type != "bf16":  # (an inference tensor: calibrated under inference_mode)
        with torch.inference_mode():
            gpu.cache.key_offset.copy_(cpu.cache.key_offset)
    for runner in (cpu, gpu):
        runner.prefill(runner.slot(0), list(range(3, 14)))
        runner.prefill(runner.slot(1), list(range(40, 45)))
    for i in range(4):
        want = cpu.decode_batch([cpu.slot(0), cpu.slot(1)], [20 + i, 60 + i])
        got = gpu.decode_batch([gpu.slot(0), gpu.slot(1)], [20 + i, 60 + i]).cpu()
        # an int4 code at a rounding boundary may flip between the two paths' float roundings: on the CPU, weights
        # 1e-6 apart (relative) move these logits by 1.5e-4 (int8), 2.9e-3 (k8v4, int4), 1.7e-5 (bf16)
        tol = 1e-3 if kv_type in ("bf16", "int8") else 1e-2
        assert (got - want).abs().max() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("m, h, n, dtype", [(1, 300, 8, torch.float32), (3, 9000, 13, torch.bfloat16),
                                            (4, 5120, 96, torch.bfloat16)])
def test_gate_project_matches_its_reference_and_the_layer(m, h, n, dtype):
    """The decode step's gate projections (norm + both gate rows in one kernel): a row count past one program's
    block, input widths past and short of one loop step, the 27B shape; against the reference, which is the
    layer's own norm and product in float32."""
    from engine.kernels.deltanet_gates import gate_project, gate_project_reference
    gen = torch.Generator().manual_seed(m + h)
    x = (torch.randn(m, h, generator=gen) * 3).to(DEVICE)
    norm = (1 + 0.1 * torch.randn(h, generator=gen)).to(DEVICE)
    weight = torch.randn(n, h, generator=gen).to(DEVICE, dtype)
    ref = gate_project_reference(x, norm, weight, 1e-6)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm  # [M, H]
    assert (ref - normed @ weight.float().T).abs().max() <= 1e-4 * (1 + ref.abs().max())
    got = gate_project(x, norm, weight, 1e-6)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())
    with pytest.raises(UnsupportedKernelShape):
        gate_project(x, norm[:-1], weight, 1e-6)


@pytest.mark.parametrize("t, c, dtype", [(1, 40, torch.float32), (2, 130, torch.float32), (70, 300, torch.bfloat16)])
def test_prefill_conv_and_gated_norm_match_their_references(t, c, dtype):
    """The prefill chunk's conv (fewer positions than the window, a chunk past one program's block) and the
    gated output norm (engine.kernels.deltanet_layer) against the layer's torch maths."""
    from engine.kernels.deltanet_layer import causal_conv as conv_kernel
    from engine.kernels.deltanet_layer import causal_conv_reference, gated_rms_norm, gated_rms_norm_reference
    gen = torch.Generator().manual_seed(t + c)
    x = torch.randn(2, t, c + 5, generator=gen).to(DEVICE, dtype)[:, :, :c]  # a strided view, as the projection's
    window = torch.randn(2, c, 3, generator=gen).to(DEVICE, dtype)
    weight = torch.randn(c, 4, generator=gen).to(DEVICE, dtype)
    got, got_window = conv_kernel(x, window, weight)
    want, want_window = causal_conv_reference(x, window, weight)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == want.shape == (2, t, c) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(got_window, want_window)  # the inputs themselves, not a sum
    o = torch.randn(2, t, 3, 32, generator=gen).to(DEVICE)
    z = torch.randn(2, t, 3, 32, generator=gen).to(DEVICE, dtype)
    norm = (1 + 0.1 * torch.randn(32, generator=gen)).to(DEVICE)
    got, want = gated_rms_norm(o, z, norm, 1e-6), gated_rms_norm_reference(o, z, norm, 1e-6)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
