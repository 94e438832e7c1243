"""The rotation a linear layer's input gets at run time when its weight holds a folded one.

One mechanism for both kinds of rotated weights: a bonsai checkpoint made with `--rotate` (the online
Hadamard on the down projections' inputs, no signs) and a PrismML GGUF (`prism.hadamard.*`: signs and a
blockwise Walsh-Hadamard transform on the inputs of the layers it names, engine.sources.prism_rotation).
The rotation lives beside the layer it feeds, not inside it (the layer may be swapped for a packed one
while loading): `Attention.wqkv_rotation` / `wo_rotation`, `FeedForward.w13_rotation` / `w2_rotation`,
`Transformer.lm_head_rotation`, None where the input is plain. One rotation per distinct input: q/k/v
(one fused product) read one rotated x, so do gate/up.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engine.sources.prism_rotation import InputRotationSpec
from quant.rotation import block_hadamard_factors, signed_block_hadamard


class InputRotation(nn.Module):
    """x [.., K] → WHT_b(x ⊙ s), computed in float32 and returned in x's dtype (quant.rotation)."""

    def __init__(self, spec: InputRotationSpec, device: torch.device | str):
        super().__init__()
        self.width, self.block = spec.width, spec.block
        signs = None if spec.signs is None else torch.tensor(spec.signs, dtype=torch.float32, device=device)
        self.register_buffer("signs", signs, persistent=False)  # [K] ±1, or None: all +1
        h1, h2 = block_hadamard_factors(spec.block, torch.float32, device)
        self.register_buffer("h1", h1, persistent=False)  # [b1, b1], H_b = H_b1 ⊗ H_b2
        self.register_buffer("h2", h2, persistent=False)  # [b2, b2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.shape[-1] == self.width, f"a rotation of width {self.width} got an input of width {x.shape[-1]}"
        return signed_block_hadamard(x, self.signs, self.h1, self.h2)  # [.., K]


def rotated(rotation: InputRotation | None, x: torch.Tensor) -> torch.Tensor:
    """x as the layer after `rotation` reads it (unchanged where there is none)."""
    return x if rotation is None else rotation(x)


def set_input_rotations(model: nn.Module, specs: dict[str, InputRotationSpec],
                        device_of: Callable[[str], torch.device]) -> None:
    """Put each spec beside its linear layer (global module path, e.g. layers.3.feed_forward.w2 or lm_head)
    on `device_of(path)`; a pipeline stage's model takes the ones of its own blocks only."""
    first, held = getattr(model, "first_layer", 0), len(model.layers)
    for path, spec in specs.items():
        parent, _, attr = path.rpartition(".")
        if parent:
            _, layer, sub = parent.split(".")
            if not first <= int(layer) < first + held:
                continue
            owner = getattr(model.layers[int(layer) - first], sub)
        elif not getattr(model, "gives_logits", True):
            continue
        else:
            owner = model
        assert hasattr(owner, f"{attr}_rotation"), f"{path} has no input rotation slot"
        setattr(owner, f"{attr}_rotation", InputRotation(spec, device_of(path)))
