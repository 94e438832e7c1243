"""What the Triton chunked gated delta rule (engine.kernels.deltanet_prefill) allocates, without importing
triton: the memory plan counts it on machines that have none."""
from __future__ import annotations

CHUNK = 64  # positions per chunk of the chunked prefill


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_scratch_bytes(batch: int, rows: int, value_heads: int, key_dim: int, value_dim: int) -> int:
    """Bytes `chunk_gated_delta_rule_triton` allocates for `rows` positions of `batch` sequences: w, kd, u, v'
    [NT, ·] and cum per value head, the state before each chunk, and the float32 output."""
    nt = -(-rows // CHUNK) * CHUNK
    bk, bvs = max(16, _pow2(key_dim)), max(16, _pow2(value_dim))
    return 4 * batch * value_heads * (nt * (2 * bk + 2 * bvs + 1) + nt // CHUNK * bk * bvs + rows * value_dim)
