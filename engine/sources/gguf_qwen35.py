"""llama.cpp's `qwen35` GGUFs (Qwen3.5 / Qwen3.6 hybrids): tensor names and every value transform
llama.cpp's converter applies between the HF tensors and the file, both ways: from_stored /
codes_from_stored for reading, to_stored / codes_to_stored for the export (docs/qwen35_gguf.md has
the facts and where they come from).

Canonical names are hf_files' (`layers.{i}.in_proj_qkv.weight`, `layers.{i}.A_log.param`, ...). The
converter's transforms, undone on read:
- every RMSNorm weight but the DeltaNet output norm is stored + 1 (Qwen3.5 norms scale by 1 + w);
- A_log is stored as ssm_a = -exp(A_log); dt_bias is ssm_dt.bias;
- conv1d [C, 1, K] is stored squeezed [C, K];
- with fewer key heads than value heads, the value heads are reordered from grouped (by key head)
  to tiled: rows of the V part of in_proj_qkv, of in_proj_z, in_proj_b, in_proj_a, the V channels of
  conv1d, A_log, dt_bias, and the columns of out_proj.
"""
from __future__ import annotations

import re

import torch

from engine.sources.model_config import ModelConfig

_TOP_LEVEL = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_BLOCK = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
          "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
          "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj",
          "attn_qkv": "in_proj_qkv", "attn_gate": "in_proj_z", "ssm_beta": "in_proj_b", "ssm_alpha": "in_proj_a",
          "ssm_out": "out_proj", "ssm_conv1d": "conv1d", "ssm_norm": "linear_norm"}
# stored without the .weight kind: ssm_a (no suffix at all) and ssm_dt.bias
_PARAMS = {"ssm_a": ("", "A_log"), "ssm_dt": (".bias", "dt_bias")}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)(\.weight|\.bias|)$")
_PLUS_ONE = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def canonical_name(gguf_name: str, num_layers: int | None = None) -> str | None:
    """Our name for a qwen35 GGUF tensor name, or None for tensors we do not use (the MTP blocks
    appended after `num_layers` among them)."""
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
        if num_layers is not None and layer >= num_layers:
            return None
        if part in _PARAMS:
            suffix, canon = _PARAMS[part]
            return f"layers.{layer}.{canon}.param" if kind == suffix else None
        return f"layers.{layer}.{_BLOCK[part]}{kind}" if part in _BLOCK and kind else None
    stem, _, kind = gguf_name.rpartition(".")
    part = _TOP_LEVEL.get(stem)
    return f"{part}.{kind}" if part else None


def gguf_name(canonical: str) -> str:
    """The qwen35 GGUF name of a canonical tensor name (the inverse of canonical_name)."""
    stem, _, kind = canonical.rpartition(".")
    top = {v: k for k, v in _TOP_LEVEL.items()}
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, layer, part = stem.split(".")
    params = {canon: (gguf, suffix) for gguf, (suffix, canon) in _PARAMS.items()}
    if part in params:
        return f"blk.{layer}.{params[part][0]}{params[part][1]}"
    return f"blk.{layer}.{ {v: k for k, v in _BLOCK.items()}[part]}.{kind}"


def canonical_shape(name: str, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a stored (torch-order) tensor has once read: conv1d gets its middle axis back."""
    if name.endswith("conv1d.weight") and len(stored) == 2:
        return (stored[0], 1, stored[1])
    return tuple(stored)


def transformed(name: str) -> bool:
    """Whether read_tensor changes this tensor's values or order (so its rows cannot be read alone)."""
    part = name.split(".")[-2] if name.startswith("layers.") else ""
    return name.endswith(_PLUS_ONE) or part in ("A_log", "dt_bias", "conv1d", "in_proj_qkv", "in_proj_z",
                                                "in_proj_b", "in_proj_a", "out_proj")


def _grouped(t: torch.Tensor, dim: int, config: ModelConfig, head_dim: int) -> torch.Tensor:
    """Value heads from llama.cpp's tiled order [r0: K0 K1 .., r1: K0 K1 ..] back to HF's grouped order
    [K0: r0 r1 .., K1: r0 r1 ..] along `dim` (the inverse of the converter's _reorder_v_heads)."""
    hc = config.hybrid
    per_k = hc.linear_num_value_heads // hc.linear_num_key_heads
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_k, hc.linear_num_key_heads, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _tiled(t: torch.Tensor, dim: int, config: ModelConfig, head_dim: int) -> torch.Tensor:
    """Value heads from HF's grouped order [K0: r0 r1 .., K1: ..] to llama.cpp's tiled order
    [r0: K0 K1 .., r1: ..] along `dim` (the converter's _reorder_v_heads; the inverse of _grouped)."""
    hc = config.hybrid
    per_k = hc.linear_num_value_heads // hc.linear_num_key_heads
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], hc.linear_num_key_heads, per_k, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _reordered(config: ModelConfig) -> bool:
    hc = config.hybrid
    return hc.linear_num_key_heads != hc.linear_num_value_heads


def from_stored(name: str, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A decoded qwen35 tensor (float32, torch order as stored) as the HF checkpoint holds it."""
    if name.endswith(_PLUS_ONE) or name == "norm.weight":
        return t - 1
    part = name.split(".")[-2] if name.startswith("layers.") else ""
    hc, reorder = config.hybrid, _reordered(config)
    if part == "A_log":
        t = torch.log(-t)  # [Hv]
    if part == "conv1d":
        t = t.reshape(t.shape[0], 1, t.shape[-1])  # [C, 1, K]
    if not reorder:
        return t
    vd = hc.linear_value_head_dim
    if part in ("A_log", "dt_bias", "in_proj_b", "in_proj_a"):
        return _grouped(t, 0, config, 1)  # [Hv] or [Hv, hidden]
    if part == "in_proj_z":
        return _grouped(t, 0, config, vd)  # [Hv * Dv, hidden]
    if part in ("in_proj_qkv", "conv1d"):
        qk = 2 * hc.key_dim
        return torch.cat([t[:qk], _grouped(t[qk:], 0, config, vd)])  # [2 Hk Dk + Hv Dv, ...]
    if part == "out_proj":
        return _grouped(t, 1, config, vd)  # [hidden, Hv * Dv]
    return t


def to_stored(name: str, t: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """An HF-order tensor as llama.cpp's converter writes it (torch order; the inverse of from_stored):
    the value transforms in float32, the reorders and the conv1d squeeze in the tensor's own dtype."""
    if name.endswith(_PLUS_ONE) or name == "norm.weight":
        return t.float() + 1
    part = name.split(".")[-2] if name.startswith("layers.") else ""
    hc, reorder = config.hybrid, _reordered(config)
    if part == "A_log":
        t = -torch.exp(t.float())  # [Hv]
    if part == "conv1d":
        t = t.reshape(t.shape[0], t.shape[-1])  # [C, K]
    if not reorder:
        return t
    vd = hc.linear_value_head_dim
    if part in ("A_log", "dt_bias", "in_proj_b", "in_proj_a"):
        return _tiled(t, 0, config, 1)
    if part == "in_proj_z":
        return _tiled(t, 0, config, vd)
    if part in ("in_proj_qkv", "conv1d"):
        qk = 2 * hc.key_dim
        return torch.cat([t[:qk], _tiled(t[qk:], 0, config, vd)])
    if part == "out_proj":
        return _tiled(t, 1, config, vd)
    return t


def codes_to_stored(name: str, codes: torch.Tensor, scales: torch.Tensor, config: ModelConfig
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Quantized codes [N, K] and group scales [N, K/G] of an HF-order matrix in the file's order (the
    inverse of codes_from_stored), or None where the reorder splits a scale group (out_proj with
    linear_value_head_dim % G != 0: the export writes it as floats)."""
    part = name.split(".")[-2]
    if not _reordered(config) or part not in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        return codes, scales
    if part != "out_proj":
        rows = to_stored(name, torch.arange(codes.shape[0])[:, None], config)[:, 0]
        return codes[rows], scales[rows]
    group = codes.shape[1] // scales.shape[1]
    vd = config.hybrid.linear_value_head_dim
    if _splits_groups(name, group, True, vd):
        return None
    cols = _tiled(torch.arange(codes.shape[1])[None, :], 1, config, vd)[0]  # [K]
    return codes[:, cols], scales[:, cols[::group] // group]


def splits_groups(name: str, group: int, config: ModelConfig) -> bool:
    """Whether the V-head reorder of this canonical matrix splits scale groups of `group` columns (so its
    codes cannot move as they are); never for a dense model."""
    return config.hybrid is not None and _splits_groups(name, group, _reordered(config),
                                                        config.hybrid.linear_value_head_dim)


def codes_from_stored(name: str, codes: torch.Tensor, scales: torch.Tensor, config: ModelConfig
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stored quantized codes [N, K] and group scales [N, K/G] of a qwen35 matrix in HF order, or
    None where the reorder splits a scale group (out_proj with head_dim % G != 0: decoded as floats)."""
    part = name.split(".")[-2]
    if not _reordered(config) or part not in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        return codes, scales
    if part != "out_proj":
        rows = from_stored(name, torch.arange(codes.shape[0], dtype=torch.float64)[:, None], config)[:, 0].long()
        return codes[rows], scales[rows]
    group = codes.shape[1] // scales.shape[1]
    vd = config.hybrid.linear_value_head_dim
    if _splits_groups(name, group, True, vd):
        return None
    cols = _grouped(torch.arange(codes.shape[1])[None, :], 1, config, vd)[0]  # [K]
    return codes[:, cols], scales[:, cols[::group] // group]


def _splits_groups(name: str, group: int, reordered: bool, value_head_dim: int) -> bool:
    return reordered and name.endswith("out_proj.weight") and value_head_dim % group != 0


def keeps_codes(name: str, group: int, meta: dict) -> bool:
    """Whether a matrix's stored codes (scale groups of `group` along a row) stay packable once the
    V-head reorder is undone, from the file's metadata alone (engine.weights.formats.stored_formats)."""
    nk, nv, inner = (meta.get(f"qwen35.ssm.{k}") for k in ("group_count", "time_step_rank", "inner_size"))
    if not all(isinstance(v, int) and v > 0 for v in (nk, nv, inner)):
        return False  # model_config() refuses the file
    return not _splits_groups(name, group, nk != nv, inner // nv)
