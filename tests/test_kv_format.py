import pytest

from quant.kv_format import KV_TYPES, kv_bytes_per_token, row_bytes


def test_row_bytes_by_hand():
    assert row_bytes("float", 128) == 256
    assert row_bytes("float", 128, float_bytes=4) == 512
    assert row_bytes("int8", 128) == 130  # 128 codes + one fp16 scale
    assert row_bytes("int4", 128) == 64 + 4 * 4  # 64 bytes of nibbles + 4 groups × (scale, min)
    with pytest.raises(ValueError):
        row_bytes("int4", 48)


def test_qwen3_8b_kv_per_token():
    # 36 layers, 8 KV heads, head_dim 128: 144 KiB per token in bf16 (the well-known figure)
    assert kv_bytes_per_token(KV_TYPES["bf16"], 36, 8, 128) == 36 * 8 * 512 == 147456
    assert kv_bytes_per_token(KV_TYPES["int8"], 36, 8, 128) == 36 * 8 * 260
    assert kv_bytes_per_token(KV_TYPES["k8v4"], 36, 8, 128) == 36 * 8 * (130 + 80)
    assert not KV_TYPES["bf16"].quantized and KV_TYPES["k8v4"].quantized
