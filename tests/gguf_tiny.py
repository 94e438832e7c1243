"""Writes tiny GGUF models (random weights, real SmolLM2 tokenizer metadata) for loader tests."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf.gguf_writer import GGUFValue
from gguf import quants as gguf_quants

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
TINY_VOCAB = 1024
K_QUANTS = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
# byte offsets of the fp16 scale fields in each K-quant block of 256 weights (block size in bytes)
_K_LAYOUT = {T.Q2_K: (84, [80, 82]), T.Q3_K: (110, [108]), T.Q4_K: (144, [0, 2]),
             T.Q5_K: (176, [0, 2]), T.Q6_K: (210, [208])}


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(source: str, vocab: int = TINY_VOCAB) -> dict:
    """The source's tokenizer cut to its first `vocab` tokens and the merges among them."""
    reader = GGUFReader(source)
    f = {k: v.contents() for k, v in reader.fields.items() if k.startswith("tokenizer.")}
    tokens = f["tokenizer.ggml.tokens"][:vocab]
    kept = set(tokens)
    merges = [m for m in f["tokenizer.ggml.merges"]
              if (parts := m.split(" ")) and len(parts) == 2 and parts[0] in kept and parts[1] in kept
              and parts[0] + parts[1] in kept]
    f["tokenizer.ggml.tokens"] = tokens
    f["tokenizer.ggml.token_type"] = f["tokenizer.ggml.token_type"][:vocab]
    f["tokenizer.ggml.merges"] = merges
    return f


def copy_tokenizer(writer: GGUFWriter, source: Path) -> int:
    """Copy the tokenizer.* metadata of a real GGUF; return its vocabulary size."""
    f = _tokenizer_fields(str(source))
    writer.add_tokenizer_model(f["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    writer.add_token_list(f["tokenizer.ggml.tokens"])
    writer.add_token_types(f["tokenizer.ggml.token_type"])
    writer.add_token_merges(f["tokenizer.ggml.merges"])
    writer.add_bos_token_id(f["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(f["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(bool(f.get("tokenizer.ggml.add_bos_token", False)))
    writer.add_chat_template(f["tokenizer.chat_template"])
    return len(f["tokenizer.ggml.tokens"])


def random_k_quant_bytes(rng: np.random.Generator, qtype: T, rows: int, cols: int) -> np.ndarray:
    block_bytes, fp16_offsets = _K_LAYOUT[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    for off in fp16_offsets:
        blocks[:, :, off:off + 2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, tokenizer_source: Path, weight_type: T = T.F32, arch: str = "llama",
                    seed: int = 0, tied: bool = False, meta: dict | None = None, skip: frozenset = frozenset()
                    ) -> Path:
    """tied: no output.weight (the embedding is the output layer too). meta: metadata keys to
    replace, {key: (value, GGUFValueType)} or {key: None} to leave it out; skip: tensors left out."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = copy_tokenizer(writer, tokenizer_source)
    head_dim = HIDDEN // HEADS

    def add(name: str, rows: int, cols: int | None) -> None:
        if name in skip:
            return
        if cols is None:  # norms stay F32
            writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(rows)).astype(np.float32))
            return
        if weight_type in K_QUANTS:
            raw = random_k_quant_bytes(rng, weight_type, rows, cols)
            writer.add_tensor(name, raw, raw_dtype=weight_type)
            return
        w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        if weight_type == T.F32:
            writer.add_tensor(name, w)
        elif weight_type == T.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            q = gguf_quants.quantize(w, weight_type)
            writer.add_tensor(name, q, raw_dtype=weight_type)

    add("token_embd.weight", vocab, HIDDEN)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", HIDDEN, None)
        add(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
        add(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        add(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        add(f"blk.{i}.ffn_norm.weight", HIDDEN, None)
        add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    add("output_norm.weight", HIDDEN, None)
    if not tied:
        add("output.weight", vocab, HIDDEN)
    for key, value in (meta or {}).items():
        if value is None:
            writer.kv_data[0].pop(key, None)
        else:
            writer.kv_data[0][key] = GGUFValue(*value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
