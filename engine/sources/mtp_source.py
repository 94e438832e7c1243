"""The native multi-token-prediction (MTP) head a Qwen3.5 / Qwen3.6 checkpoint carries, read from any
of the three sources: a Hugging Face directory (`mtp.*` tensors, which transformers drops on load), a
llama.cpp `qwen35` GGUF (the MTP layers appended as blocks num_layers.. with `nextn.*` tensors, written
by llama.cpp's converter `_Qwen35MtpMixin`), or a bonsai checkpoint (`mtp.*` entries, copied by
`bonsai quantize`).

Layout (vLLM's qwen3_5_mtp / Qwen3_5MultiTokenPredictor): `fc` [H, 2H] over the concatenation of the
normed embedding of token p + 1 (`pre_fc_norm_embedding`) and the normed hidden state of position p
(`pre_fc_norm_hidden`), `layers.{i}` full-attention decoder layers of the model's own kind (gated
attention, q/k norms, partial rotary; a dense MLP), a final `norm`, then the model's own LM head.

Tensors are returned in the Hugging Face convention (RMSNorm weights w of x·(1 + w); the GGUF's +1
undone) under short names: fc.weight, pre_fc_norm_embedding.weight, pre_fc_norm_hidden.weight,
norm.weight, and layers.{i}.{part}.{kind} with bonsai's canonical parts (q_proj, input_layernorm, ...).
"""
from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from engine.errors import ModelFileError
from engine.sources import gguf_qwen35, hf_files

TOP = ("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
# llama.cpp's names of the top tensors, repeated in every MTP block (blk.{num_layers + i}.nextn.*)
NEXTN = {"nextn.eh_proj.weight": "fc.weight", "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
          "nextn.hnorm.weight": "pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "norm.weight"}
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def short_name(stored: str) -> str | None:
    """The short name of an HF / bonsai-checkpoint `mtp.*` tensor name, or None if it is not one we use."""
    if not stored.startswith("mtp."):
        return None
    rest = stored[len("mtp."):]
    if rest in TOP:
        return rest
    m = _MTP_LAYER.match(stored)
    if m is None:
        return None
    canon = hf_files.canonical_name(f"model.layers.{m.group(1)}.{m.group(2)}")
    return canon if canon is not None and canon.startswith("layers.") else None


def stored_names(source: Any, num_layers: int) -> dict[str, str]:
    """{short name: stored name} of the MTP tensors the source holds (empty when it holds none)."""
    names: dict[str, str] = {}
    meta = getattr(source, "metadata", None) or {}
    if meta.get("general.architecture") == "qwen35":  # a GGUF: blocks num_layers.., the top tensors in each
        for stored in source.tensor_names:
            m = _GGUF_BLOCK.match(stored)
            if m is None or int(m.group(1)) < num_layers:
                continue
            i = int(m.group(1)) - num_layers
            if m.group(2) in NEXTN:
                if i == 0:
                    names[NEXTN[m.group(2)]] = stored
                continue
            canon = gguf_qwen35.canonical_name(stored)
            if canon is not None:
                names[f"layers.{i}." + canon.split(".", 2)[2]] = stored
        return names
    for stored in _tensor_names(source):
        short = short_name(stored)
        if short is not None:
            names[short] = stored
    if any(n.startswith("mtp.embed_tokens") for n in _tensor_names(source)):
        raise ModelFileError(f"{source.path}: its MTP head has an embedding of its own (mtp.embed_tokens); "
                             "bonsai runs MTP heads that share the model's embedding")
    return names


def mtp_layer_count(source: Any, num_layers: int) -> int:
    """MTP layers the source both declares (or, for an HF directory without the key, holds) and has tensors of."""
    names = stored_names(source, num_layers)
    held = {int(n.split(".")[1]) for n in names if n.startswith("layers.")}
    return len(held) if names else 0


def read_mtp_tensors(source: Any, config: Any) -> dict[str, torch.Tensor]:
    """Every MTP tensor of the source as float32 in the HF convention (see the module doc)."""
    return dict(iter_mtp_tensors(source, config))


def iter_mtp_tensors(source: Any, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(short name, float32 tensor) one at a time (a quantize run copies them without holding them all)."""
    names = stored_names(source, config.num_layers)
    gguf = (getattr(source, "metadata", None) or {}).get("general.architecture") == "qwen35"
    for short, stored in names.items():
        if not gguf:
            yield short, _read_named(source, stored)
        elif short in TOP:
            tensor = source.read_stored(stored)
            yield short, tensor if short == "fc.weight" else tensor - 1  # the norms: the converter's + 1
        else:
            layer = config.num_layers + int(short.split(".")[1])
            yield short, source.read_tensor(f"layers.{layer}." + short.split(".", 2)[2], config)


def _tensor_names(source: Any) -> list[str]:
    checkpoint = getattr(source, "checkpoint", None)
    if checkpoint is not None:
        return list(checkpoint.entries)
    return [name for name, _, _, _ in source.tensor_info()]


def _read_named(source: Any, stored: str) -> torch.Tensor:
    checkpoint = getattr(source, "checkpoint", None)
    if checkpoint is not None:
        return source._read(stored, checkpoint.read_dequantized).float()
    from safetensors import safe_open
    for file in source.weight_files:
        with hf_files._open(file, safe_open) as f:
            if stored in f.keys():
                return f.get_tensor(stored).float()
    raise ModelFileError(f"{source.path}: tensor {stored} is listed but not found in its safetensors files")
