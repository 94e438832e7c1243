"""PEFT LoRA adapters merged into float weights: W += (B @ A) * alpha / r (alpha / sqrt(r) with rsLoRA).

An adapter directory holds adapter_config.json and adapter_model.safetensors with tensors named
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r].
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import BonsaiError
from quant.checkpoint import CheckpointError, SafetensorsFile

_PREFIX = "base_model.model."


@dataclass
class LoraAdapter:
    path: Path
    scale: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # HF weight name → (A [r, in], B [out, r])

    def check_fits(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """A one-line error if the adapter was made for another base model."""
        for name, (a, b) in self.pairs.items():
            if name not in shapes:
                raise BonsaiError(f"LoRA adapter {self.path} is for another base model: the source has no "
                                  f"{name.removesuffix('.weight')}")
            out_features, in_features = shapes[name]
            if b.shape[0] != out_features or a.shape[1] != in_features:
                raise BonsaiError(f"LoRA adapter {self.path} is for another base model: {name} is "
                                  f"{out_features}x{in_features} in the source, {b.shape[0]}x{a.shape[1]} in the adapter")

    def merge(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The weight with the adapter's update added (the weight itself if the adapter leaves it)."""
        if name not in self.pairs:
            return weight
        a, b = self.pairs[name]
        return (weight.float() + (b.float() @ a.float()) * self.scale).to(weight.dtype)  # [out, in]


def load_adapter(path: Path) -> LoraAdapter:
    path = Path(path)
    config_path, weights_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise BonsaiError(f"{path} is not a PEFT LoRA adapter: it needs adapter_config.json and "
                          "adapter_model.safetensors")
    try:
        config = json.loads(config_path.read_text())
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (ValueError, KeyError, TypeError) as e:
        raise BonsaiError(f"{config_path} is not a valid LoRA config ({type(e).__name__}: {e})") from None
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("fan_in_fan_out"):
        raise BonsaiError(f"{path}: only plain LoRA adapters are merged (not DoRA, fan_in_fan_out or "
                          f"{config.get('peft_type')})")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        st = SafetensorsFile(weights_path)
        tensors = {name: st.read(name) for name in st.entries}
    except (CheckpointError, OSError) as e:
        raise BonsaiError(f"{weights_path} is not a valid safetensors file ({e})") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module = name.removeprefix(_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in module:
                base = module.split(marker)[0]
                halves.setdefault(f"{base}.weight", {})[part] = tensor
                break
        else:
            raise BonsaiError(f"{weights_path}: tensor {name} is not a LoRA A/B matrix (modules_to_save and "
                              "embedding adapters are not supported)")
    pairs = {}
    for name, parts in halves.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise BonsaiError(f"{weights_path}: {name} has only one of lora_A / lora_B")
        a, b = parts["lora_A"], parts["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise BonsaiError(f"{weights_path}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} of {name} "
                              "do not fit each other")
        pairs[name] = (a, b)
    if not pairs:
        raise BonsaiError(f"{weights_path} holds no LoRA matrices")
    return LoraAdapter(path=path, scale=scale, pairs=pairs)
