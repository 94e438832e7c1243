"""The masked prefill attention a GPU runs in query blocks with grouped-query heads folded into the
query axis (engine.runtime.model.blocked_attention) against PyTorch's one-call attention with a mask."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.runtime import model


def test_blocked_attention_equals_one_masked_call(one_thread, monkeypatch):
    g = torch.Generator().manual_seed(0)
    b, h, kv, t, s, d = 2, 8, 2, 9, 20, 16
    q, k, v = torch.randn(b, h, t, d, generator=g), torch.randn(b, kv, s, d, generator=g), torch.randn(b, kv, s, d, generator=g)
    positions = torch.tensor([[11], [5]]) + torch.arange(t)  # [B, T]: two slots at different lengths
    mask = torch.arange(s)[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    monkeypatch.setattr(model, "ATTENTION_SCORE_BYTES", h * s * 4 * 4)  # 4 query rows per block: 3 blocks
    assert model.attention_block_rows(h, s, t) == 4
    torch.testing.assert_close(model.blocked_attention(q, k, v, mask), want, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(model, "ATTENTION_SCORE_BYTES", 1 << 30)  # one block
    torch.testing.assert_close(model.blocked_attention(q, k, v, mask), want, rtol=1e-6, atol=1e-6)
