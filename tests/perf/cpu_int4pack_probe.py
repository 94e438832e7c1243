"""Probe of torch's CPU int4 kernel for GGUF Q4_K-style affine groups: exactness per activation dtype, row-count
independence (verify rows vs the decode row), and one-matrix time against the float16 gemv. Not a test (timing).
Run: .venv/bin/python tests/perf/cpu_int4pack_probe.py"""
import time

import torch
torch.manual_seed(0)
N, K, G = 1536, 1536, 32
q = torch.randint(0, 16, (N, K), dtype=torch.int32)
scale = torch.rand(N, K // G) * 0.01 + 0.001
mn = torch.rand(N, K // G) * 0.05
# Q4_K-like affine: w = scale*q - mn ; int4pack: w = (q-8)*s + z  =>  s=scale, z = 8*scale - mn
w = (q.float().view(N, K // G, G) * scale[..., None] - mn[..., None]).view(N, K)
packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    s = scale.to(dt); z = (8 * scale - mn).to(dt)
    sz = torch.stack([s, z], -1).transpose(0, 1).contiguous()  # [K/G, N, 2]
    x = torch.randn(1, K, dtype=dt)
    try:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz)
    except Exception as e:
        print(dt, "error", str(e).splitlines()[0]); continue
    ref = x.float() @ ((q.float().view(N, K//G, G) - 8) * s.float()[..., None] + z.float()[..., None]).view(N, K).t()
    ex = x.float() @ w.t()
    y4 = torch.ops.aten._weight_int4pack_mm_for_cpu(x.repeat(4, 1), packed, G, sz)
    print(dt, "max|y-ref(same scales)|", (y.float() - ref).abs().max().item(), "max|y-exact|", (y.float() - ex).abs().max().item(),
          "|ex|max", ex.abs().max().item(), "row0 of 4 rows bit-identical:", torch.equal(y4[:1], y))
    t = []
    for _ in range(20):
        t0 = time.perf_counter(); torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz); t.append(time.perf_counter() - t0)
    w16 = w.half(); xf = x.float()
    t2 = []
    for _ in range(20):
        t0 = time.perf_counter(); torch.mv(w16, xf.reshape(-1).half()); t2.append(time.perf_counter() - t0)
    print("  median int4pack %.3f ms  fp16 mv %.3f ms" % (sorted(t)[10] * 1e3, sorted(t2)[10] * 1e3))
