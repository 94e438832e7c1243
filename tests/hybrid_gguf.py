"""Converts a tiny HF Qwen3.5 directory (tests/hybrid_tiny.py) into a llama.cpp `qwen35` GGUF the way
llama.cpp's converter does (conversion/qwen.py of ggml-org/llama.cpp: Qwen3_5TextModel =
_Qwen35MtpMixin + _Qwen35MRopeMixin + _LinearAttentionVReorderBase over Qwen3NextModel). Names come
from the gguf package's own tensor map for MODEL_ARCH.QWEN35, as the converter's map_tensor_name."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, MODEL_ARCH, get_tensor_name_map
from gguf import quants as gguf_quants
from gguf.gguf_writer import GGUFValue
from safetensors.torch import load_file

from tests.gguf_tiny import _tokenizer_fields


def _reorder_v_heads(t: torch.Tensor, dim: int, num_k: int, per_k: int, head_dim: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: grouped (by key head) → tiled value heads."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], num_k, per_k, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def convert_tensor(name: str, t: torch.Tensor, hp: dict) -> torch.Tensor:
    """One HF tensor's values as the converter writes them."""
    nk, nv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    dk, dv, per_k = hp["linear_key_head_dim"], hp["linear_value_head_dim"], nv // nk
    # _LinearAttentionVReorderBase.modify_tensors: only when num_k_heads != num_v_heads, linear_attn.* only
    if nk != nv and "linear_attn." in name:
        if ".in_proj_qkv." in name:  # "QKV weight: reorder only the V rows"
            qk = 2 * dk * nk
            t = torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, nk, per_k, dv)])
        elif ".in_proj_z." in name:
            t = _reorder_v_heads(t, 0, nk, per_k, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            t = _reorder_v_heads(t, 0, nk, per_k, 1)
        elif ".A_log" in name or ".dt_bias" in name:  # 1-D, num_v_heads elements
            t = _reorder_v_heads(t.unsqueeze(-1), 0, nk, per_k, 1).squeeze(-1)
        elif ".conv1d" in name:  # data.squeeze(), then only the V channels
            t = t.squeeze()
            qk = 2 * dk * nk
            t = torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, nk, per_k, dv)])
        elif ".out_proj." in name:  # columns (the input dimension)
            t = _reorder_v_heads(t, 1, nk, per_k, dv)
    # Qwen3NextModel.modify_tensors
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return t


def gguf_tensor_name(name: str, num_layers: int) -> str:
    """Qwen3NextModel renames .dt_bias to .dt_proj.bias, then map_tensor_name(try_suffixes=(.weight, .bias))."""
    if name.endswith(".dt_bias"):
        name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
    new = get_tensor_name_map(MODEL_ARCH.QWEN35, num_layers).get_name(name, try_suffixes=(".weight", ".bias"))
    assert new is not None, name
    return new


# _Qwen35MtpMixin.modify_tensors: mtp.* tops → model.layers.{bid}.* for every MTP block bid (gguf 0.19's
# QWEN35 tensor list lacks the NEXTN kinds its map would need, so their GGUF names are spelled here)
_MTP_TOP = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
            "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}


def mtp_tensors(name: str, t: torch.Tensor, hp: dict) -> list[tuple[str, torch.Tensor]]:
    """An HF mtp.* tensor as the converter writes it: (GGUF name, values) for each MTP block."""
    layers, blocks = hp["num_hidden_layers"], hp["num_hidden_layers"] + hp.get("mtp_num_hidden_layers", 0)
    if name in _MTP_TOP:  # the norms, renamed *norm.weight (enorm, hnorm, shared_head.norm): Qwen3NextModel adds 1
        t = t if name == "mtp.fc.weight" else t + 1
        return [(f"blk.{b}.{_MTP_TOP[name]}", t) for b in range(layers, blocks)]
    bid = int(name.split(".")[2])
    hf = name.replace(f"mtp.layers.{bid}", f"model.layers.{bid + layers}")
    return [(gguf_tensor_name(hf, blocks), convert_tensor(hf, t, hp))]


def write_qwen35_gguf(hf_dir: Path, out: Path, tokenizer_source: Path, weight_type: T = T.F32,
                      meta: dict | None = None, skip: frozenset = frozenset()) -> Path:
    """meta: metadata keys to replace, {key: (value, GGUFValueType)} or {key: None} to leave out;
    skip: GGUF tensor names left out."""
    hp = json.loads((hf_dir / "config.json").read_text())
    layers, rope = hp["num_hidden_layers"], hp.get("rope_parameters") or {}
    w = GGUFWriter(str(out), "qwen35")
    # TextModel.set_gguf_parameters (the parts a dense Qwen3.5 config has)
    mtp = hp.get("mtp_num_hidden_layers", 0)
    w.add_block_count(layers + mtp)  # _Qwen35MtpMixin adds mtp_num_hidden_layers
    if mtp:
        w.add_uint32("qwen35.nextn_predict_layers", mtp)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    sections = list(rope.get("mrope_section") or [11, 11, 10])  # _Qwen35MRopeMixin's default when absent
    w.add_rope_dimension_sections((sections + [0] * 4)[:4])
    # Qwen3NextModel.set_gguf_parameters
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hp["linear_key_head_dim"])
    w.add_ssm_group_count(hp["linear_num_key_heads"])
    w.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    w.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(hp["head_dim"] * hp.get("partial_rotary_factor", 0.25)))
    f = _tokenizer_fields(str(tokenizer_source), hp["vocab_size"])
    w.add_tokenizer_model(f["tokenizer.ggml.model"])
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_bos_token_id(f["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(f["tokenizer.chat_template"])
    tensors = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors |= load_file(file)
    converted = []
    for name, t in tensors.items():
        if name.startswith("mtp."):
            converted += mtp_tensors(name, t.float(), hp)
        else:
            converted.append((gguf_tensor_name(name, layers), convert_tensor(name, t.float(), hp)))
    for new, t in converted:
        if new in skip:
            continue
        data = t.numpy()
        if data.ndim <= 1 or "ssm_conv1d" in new or weight_type == T.F32:  # 1-D tensors stay F32
            w.add_tensor(new, data.astype(np.float32))
        elif weight_type == T.F16:
            w.add_tensor(new, data.astype(np.float16))
        else:
            w.add_tensor(new, gguf_quants.quantize(data, weight_type), raw_dtype=weight_type)
    for key, value in (meta or {}).items():
        if value is None:
            w.kv_data[0].pop(key, None)
        else:
            w.kv_data[0][key] = GGUFValue(*value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
