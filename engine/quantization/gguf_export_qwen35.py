"""The `qwen35` side of `--gguf` (Qwen3.5 / Qwen3.6 hybrids; docs/qwen35_gguf.md has the facts): the
metadata as llama.cpp's converter writes it (Qwen3NextModel / _Qwen35MRopeMixin set_gguf_parameters),
tensor names and values through engine.sources.gguf_qwen35 (to_stored / codes_to_stored, the
inverses of what the reader undoes), and which tensors the V-head reorder makes lossy.

- The layer mix: `full_attention_interval` when the layers follow llama.cpp's rule (DeltaNet unless
  (i + 1) % interval == 0), else `attention.recurrent_layers`, one flag per block (read by the llama.cpp
  loaders that have that key; older ones know only the interval).
- MTP: a checkpoint's multi-token-prediction head (`mtp.*` bfloat16 entries, copied by `bonsai quantize`) is
  written as llama.cpp's converter writes it (_Qwen35MtpMixin): its layers as blocks num_layers.. (full-attention
  blocks, the model's tensor names), the four top tensors (fc, the two input norms, the final norm) as
  `blk.{b}.nextn.*` in every MTP block, block_count = layers + MTP layers and nextn_predict_layers (mtp_entries /
  mtp_stored). Without a head: block_count is the layer count and there is no nextn_predict_layers, also when
  the metadata is copied from a source GGUF that had them.
- The float32 rounding of the converter's own value transforms (norm + 1, A_log → -exp(A_log)) belongs
  to the format, as in llama.cpp's files, and is not counted as export error.
"""
from __future__ import annotations

from typing import Any

from gguf import GGUFWriter, RopeScalingType

import torch

from engine.sources import gguf_qwen35
from engine.sources.hybrid_config import LINEAR
from engine.sources.model_config import ModelConfig
from engine.sources.mtp_source import NEXTN, short_name

ARCH = "qwen35"
# keys of a source qwen35 GGUF that describe its MTP blocks: written anew (for the head the checkpoint holds)
NOT_COPIED = frozenset({f"{ARCH}.block_count", f"{ARCH}.nextn_predict_layers"})
SECTIONS = [11, 11, 10]  # _Qwen35MRopeMixin's mrope_section when the config has none
REORDER = "the V-head reorder"  # in every reason reorder_lossy gives


def full_attention_interval(layer_types: tuple[str, ...], preferred: Any = None) -> int | None:
    """The interval that gives exactly these layer kinds by llama.cpp's rule, `preferred` (the config's
    full_attention_interval) when it does; None when no interval does (a mix that is not periodic)."""
    def fits(k: int) -> bool:
        return all((kind == LINEAR) == ((i + 1) % k != 0) for i, kind in enumerate(layer_types))

    if isinstance(preferred, int) and not isinstance(preferred, bool) and preferred > 0 and fits(preferred):
        return preferred
    full = [i for i, kind in enumerate(layer_types) if kind != LINEAR]
    k = full[0] + 1 if full else len(layer_types) + 1
    return k if fits(k) else None


def text_config(hf_config: dict | None) -> dict:
    """The text model's part of a config.json (the VLM wrapper's text_config)."""
    cfg = hf_config if isinstance(hf_config, dict) else {}
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def rope_sections(hf_config: dict | None) -> list[int]:
    """rope.dimension_sections: the config's mrope_section padded to 4 ([11, 11, 10, 0] when absent)."""
    cfg = text_config(hf_config)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    if not (isinstance(sections, list) and all(isinstance(s, int) for s in sections)):
        sections = SECTIONS
    return (list(sections) + [0] * 4)[:4]


def rotary_dims(cfg: ModelConfig) -> int:
    """rope.dimension_count = int(head_dim × partial_rotary_factor), as the converter computes it (a
    factor read back from a GGUF as dimension_count / key_length gives its count back exactly)."""
    dims = cfg.head_dim * cfg.hybrid.partial_rotary_factor
    return round(dims) if abs(dims - round(dims)) < 1e-6 else int(dims)


def add_architecture(writer: GGUFWriter, cfg: ModelConfig, hf_config: dict | None, mtp_layers: int = 0) -> None:
    """The qwen35 keys of a model from a Hugging Face config (what HybridConfig.from_gguf and
    ModelConfig.from_gguf_metadata read back)."""
    hc = cfg.hybrid
    add_block_count(writer, cfg, mtp_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_sections(rope_sections(hf_config))
    writer.add_ssm_conv_kernel(hc.conv_kernel)
    writer.add_ssm_state_size(hc.linear_key_head_dim)
    writer.add_ssm_group_count(hc.linear_num_key_heads)
    writer.add_ssm_time_step_rank(hc.linear_num_value_heads)
    writer.add_ssm_inner_size(hc.value_dim)
    add_layer_mix(writer, cfg, text_config(hf_config).get("full_attention_interval"))
    writer.add_rope_dimension_count(rotary_dims(cfg))
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_scaling.factor)


def add_layer_mix(writer: GGUFWriter, cfg: ModelConfig, preferred: Any = None) -> None:
    """full_attention_interval, or attention.recurrent_layers (one bool per block) for a mix no interval gives."""
    interval = full_attention_interval(cfg.hybrid.layer_types, preferred)
    if interval is not None:
        writer.add_full_attention_interval(interval)
    else:
        writer.add_array(f"{ARCH}.attention.recurrent_layers", [kind == LINEAR for kind in cfg.hybrid.layer_types])


def add_block_count(writer: GGUFWriter, cfg: ModelConfig, mtp_layers: int = 0) -> None:
    """block_count (the layers and the MTP blocks after them) and nextn_predict_layers where there are MTP
    blocks; also what replaces NOT_COPIED when the metadata comes from a source qwen35 GGUF."""
    writer.add_block_count(cfg.num_layers + mtp_layers)
    if mtp_layers:
        writer.add_uint32(f"{ARCH}.nextn_predict_layers", mtp_layers)


# the MTP head's top tensors (checkpoint entries) and their llama.cpp names, repeated in every MTP block
MTP_TOP = {f"mtp.{short}": nextn for nextn, short in NEXTN.items()}


def mtp_entries(entry_names, cfg: ModelConfig) -> tuple[int, list[tuple[str, str, str]]]:
    """(MTP layers, [(checkpoint entry, GGUF name, canonical name of the values' transform)]) of a
    checkpoint's `mtp.*` entries, in the order they are written: a layer tensor once, as block
    num_layers + i; a top tensor in every MTP block."""
    layer_tensors, tops = [], []
    for name in entry_names:
        short = short_name(name)
        if short is None:
            continue
        if name in MTP_TOP:
            tops.append(name)
        else:  # layers.{i}.{part}.{kind} → the block after the model's layers, as the model's tensor
            i, rest = short.split(".", 2)[1:]
            canon = f"layers.{cfg.num_layers + int(i)}.{rest}"
            layer_tensors.append((name, gguf_qwen35.gguf_name(canon), canon))
    layers = len({int(c.split(".")[1]) for _, _, c in layer_tensors})
    if not layers:
        return 0, []
    out = list(layer_tensors)
    for b in range(cfg.num_layers, cfg.num_layers + layers):
        out += [(name, f"blk.{b}.{MTP_TOP[name]}", name) for name in tops]
    return layers, out


def mtp_stored(canon: str, w: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """An MTP tensor's values as the converter writes them: the norms + 1 (in float32), the rest as they are."""
    if canon in MTP_TOP:
        return w if canon == "mtp.fc.weight" else w.float() + 1
    return gguf_qwen35.to_stored(canon, w, cfg)


def reorder_lossy(canonical: str, quant_type: str, group: int, cfg: ModelConfig) -> str | None:
    """Why a packed matrix of an otherwise exact type is written as F16 (its scale groups split by the
    V-head reorder), or None."""
    if cfg.hybrid is None or not gguf_qwen35.splits_groups(canonical, group, cfg):
        return None
    return (f"{quant_type} g{group} → F16: {REORDER} splits its scale groups of {group} columns across "
            f"value heads of {cfg.hybrid.linear_value_head_dim}")


def forces_f32(canonical: str, cfg: ModelConfig) -> bool:
    """ssm_conv1d is F32 in llama.cpp's files (the converter keeps SSM_CONV1D in float32; ggml_ssm_conv
    takes F32 weights)."""
    return cfg.hybrid is not None and canonical.endswith("conv1d.weight")


def stored_shape(canonical: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[int, ...]:
    """The torch-order shape a tensor is written with (conv1d [C, 1, K] squeezed to [C, K])."""
    if cfg.hybrid is not None and canonical.endswith("conv1d.weight") and len(shape) == 3:
        return (shape[0], shape[2])
    return tuple(shape)
