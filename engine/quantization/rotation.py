"""`bonsai quantize --rotate`: a Hadamard rotation folded into a model's weights, tensor by tensor.

The RMSNorm weights are folded into the linears that read them (q/k/v ← input_layernorm, gate/up ←
post_attention_layernorm, lm_head ← the final norm) and become 1; the residual stream is rotated
by a randomized Hadamard matrix Q [H, H]: embedding rows E·Q, q/k/v/gate/up/lm_head W·Q, o_proj and
down_proj Qᵀ·W. A tied embedding is untied (the output layer is the norm-folded, rotated copy, stored
as lm_head). Nothing changes at run time for that part: RMSNorm with unit weight commutes with Q.
Optionally (the default) the down projections also get an online Hadamard: W·H_b folded, and the
model applies I ⊗ H_b to the SwiGLU output (b the largest power of two dividing the FFN width;
1536 = 3 · 512 → 512). The checkpoint records it (quant.checkpoint, `bonsai.rotation`), the loader
sets it up (FeedForward.set_down_hadamard). The maths is in quant.rotation.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Iterator

import torch

from engine.sources.checkpoint_file import canonical_name, hf_name
from engine.errors import BonsaiError
from engine.sources.model_config import ModelConfig
from quant.rotation import (block_hadamard, block_hadamard_factors, fold_norm, has_hadamard, power_of_two_block,
                            random_hadamard, rotate_input, rotate_output)

log = logging.getLogger(__name__)
_ATTN_IN = ("q_proj", "k_proj", "v_proj")
_FFN_IN = ("gate_proj", "up_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(frozen=True)
class Rotation:
    q: torch.Tensor  # [H, H] float32, orthogonal: the residual stream becomes x·Q
    down_block: int  # block of the online Hadamard on down_proj's input; 0: none
    seed: int = 0

    def metadata(self) -> dict:
        """What the checkpoint records (quant.checkpoint's `bonsai.rotation`)."""
        return {"residual": "randomized-hadamard", "seed": self.seed, "down_proj_hadamard": self.down_block}


def plan_rotation(config: ModelConfig, online: bool = True, seed: int = 0) -> Rotation:
    """The rotation of a model (raises BonsaiError, one line, where the model does not allow it)."""
    if not has_hadamard(config.hidden_size):
        raise BonsaiError(f"--rotate needs a Hadamard matrix of the hidden size {config.hidden_size}, and none is "
                          "built for that order (2^k times products of Paley orders 12, 20, 24, ...): quantize "
                          "this model without --rotate")
    block = power_of_two_block(config.intermediate_size) if online else 0
    if online and block < 2:
        log.warning("FFN width %d is odd: no online Hadamard on down_proj", config.intermediate_size)
        block = 0
    return Rotation(random_hadamard(config.hidden_size, seed).float(), block, seed)


def rotated_config(config: ModelConfig) -> ModelConfig:
    """The architecture after rotation: the output layer is its own tensor (the embedding untied)."""
    return dataclasses.replace(config, tie_word_embeddings=False)


def norm_names(config: ModelConfig) -> set[str]:
    """Canonical names of the RMSNorm weights that get folded."""
    return {"norm.weight"} | {f"layers.{i}.{n}.weight" for i in range(config.num_layers) for n in _NORMS}


def rotate_tensors(stream: Iterator[tuple[str, torch.Tensor]], config: ModelConfig, rotation: Rotation,
                   norms: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float tensor) of the source (`config` its architecture, `norms` its norm weights by
    canonical name) → the same of the rotated model (float32), one tensor at a time. A tied source's
    embedding is followed by lm_head; a copy of the embedding stored as lm_head is dropped."""
    missing = norm_names(config) - set(norms)
    if missing:
        raise BonsaiError(f"--rotate: the source lacks the norm weight {sorted(missing)[0]}")
    for name, w in stream:
        canon = canonical_name(name)
        if canon == "lm_head.weight" and config.tie_word_embeddings:
            continue
        yield name, rotate_tensor(canon, w, rotation, norms)
        if canon == "embed_tokens.weight" and config.tie_word_embeddings:
            yield "lm_head.weight", rotate_tensor("lm_head.weight", w, rotation, norms)


def rotate_tensor(canon: str | None, w: torch.Tensor, rotation: Rotation, norms: dict[str, torch.Tensor]
                  ) -> torch.Tensor:
    """One tensor (canonical name) of the source → its rotated value, float32."""
    q = rotation.q
    w = w.float()
    parts = canon.split(".") if canon else []
    if canon == "embed_tokens.weight":
        return rotate_input(w, q)  # rows E·Q
    if canon == "lm_head.weight":
        return rotate_input(fold_norm(w, norms["norm.weight"]), q)
    if canon == "norm.weight" or (len(parts) == 4 and parts[2] in _NORMS):
        return torch.ones_like(w)
    if len(parts) != 4 or parts[3] != "weight":
        return w  # biases, q/k norms, rope factors: untouched
    layer, part = parts[1], parts[2]
    if part in _ATTN_IN or part in _FFN_IN:
        norm = norms[f"layers.{layer}.{'input_layernorm' if part in _ATTN_IN else 'post_attention_layernorm'}.weight"]
        return rotate_input(fold_norm(w, norm), q)
    if part == "o_proj":
        return rotate_output(w, q)
    if part == "down_proj":
        if rotation.down_block:
            w = block_hadamard(w, *block_hadamard_factors(rotation.down_block))  # W·(I ⊗ H_b)
        return rotate_output(w, q)
    return w


def load_rotated(path, online: bool = True, seed: int = 0, device: str = "cpu"):
    """The model at `path` (HF dir, GGUF, checkpoint) in float32, rotated as `bonsai quantize --rotate`
    would before quantizing (for measurements and tests): a LoadedModel with the source's tokenizer."""
    from engine.weights.loader import load_model, model_from_tensors, open_model_source
    ref = load_model(path, device=device, dtype=torch.float32, weight_dtype=torch.float32, keep_codes=False)
    source = open_model_source(path)
    cfg = source.model_config()
    rotation = plan_rotation(cfg, online=online, seed=seed)
    norms = {n: w for n, w in source.iter_canonical_tensors(cfg) if n in norm_names(cfg)}
    stream = ((hf_name(n), w) for n, w in source.iter_canonical_tensors(cfg))
    tensors = ((canonical_name(n), w) for n, w in rotate_tensors(stream, cfg, rotation, norms))
    config = rotated_config(cfg)
    model = model_from_tensors(config, tensors, ref.device, torch.float32, torch.float32, path,
                               down_hadamard=rotation.down_block)
    return dataclasses.replace(ref, model=model, config=config)
