"""Reading Hugging Face model directories: config.json and (sharded) safetensors, never pickles."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from engine.errors import ModelFileError
from engine.sources.model_check import check_tensors, in_file
from engine.sources.model_config import ModelConfig
from engine.sources.tokenizer import Tokenizer

# model.language_model.*: the text model inside Qwen3_5ForConditionalGeneration (its vision tower is not read)
_LAYER_RE = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(self_attn|mlp|linear_attn)?\.?([a-zA-Z_0-9]+)"
                       r"(?:\.(weight|bias))?$")
# the DeltaNet layer's tensors (Qwen3.5): canonical part → its name under linear_attn.
_LINEAR_PARTS = {"in_proj_qkv": "in_proj_qkv", "in_proj_z": "in_proj_z", "in_proj_b": "in_proj_b",
                 "in_proj_a": "in_proj_a", "out_proj": "out_proj", "conv1d": "conv1d", "linear_norm": "norm",
                 "dt_bias": "dt_bias", "A_log": "A_log"}
_BARE = ("dt_bias", "A_log")  # parameters without a .weight suffix: canonical kind "param"


def canonical_name(hf_name: str) -> str | None:
    """Our canonical tensor name for a HF Llama/Qwen tensor name, or None if unused."""
    top = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "lm_head.weight"}
    hf_name = hf_name.replace("model.language_model.", "model.", 1)
    if hf_name in top:
        return top[hf_name]
    m = _LAYER_RE.match(hf_name)
    if not m:
        return None
    section, part, kind = m.group(2), m.group(3), m.group(4)
    if section == "linear_attn":
        part = "linear_norm" if part == "norm" else part
        if part not in _LINEAR_PARTS or (kind is None) != (part in _BARE):
            return None
        kind = kind or "param"
    elif kind is None:
        return None
    return f"layers.{m.group(1)}.{part}.{kind}"


_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")



def checked_config(path: Path, hf_config: dict[str, Any], tensors: Callable[[], list[tuple[str, str, tuple, int]]],
                   canonical: Callable[[str], str | None]) -> ModelConfig:
    """The ModelConfig of a directory's config.json (`hf_config`), checked against its tensors
    (`tensors()`: (name, type, shape, bytes) as tensor_info gives them, read after the config is known
    to be one we run; `canonical` maps a stored name to ours)."""
    config = in_file(path / "config.json", lambda: ModelConfig.from_hf_config(hf_config))
    found = {canon: (name, shape) for name, _, shape, _ in tensors() if (canon := canonical(name)) is not None}
    check_tensors(path, config, found, hf_name, "config.json num_hidden_layers")
    return config

def hf_name(canonical: str) -> str:
    """The Hugging Face name of a canonical tensor name (the inverse of canonical_name)."""
    top = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight", "rope_freqs": "rope_freqs"}
    if canonical in top:
        return top[canonical]
    _, layer, part, kind = canonical.split(".")
    if part in _LINEAR_PARTS:
        suffix = "" if kind == "param" else f".{kind}"
        return f"model.layers.{layer}.linear_attn.{_LINEAR_PARTS[part]}{suffix}"
    section = "self_attn." if part in _ATTENTION_PARTS else "mlp." if part in _MLP_PARTS else ""
    return f"model.layers.{layer}.{section}{part}.{kind}"


class HFModelDir:
    def __init__(self, path: Path):
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise ModelFileError(f"{self.path} has no config.json: give a Hugging Face model directory, "
                                 "a bonsai checkpoint or a .gguf file")
        try:
            self.hf_config: dict[str, Any] = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{config_path} is not valid JSON ({e})") from None
        except OSError as e:
            raise ModelFileError(f"cannot read {config_path}: {e.strerror or e}; check its permissions") from None
        self.weight_files = self._find_weight_files()

    def _find_weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                    raise TypeError("weight_map must map tensor names to file names")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise ModelFileError(f"{index} is not a valid safetensors index ({e})") from None
            except OSError as e:
                raise ModelFileError(f"cannot read {index}: {e.strerror or e}; check its permissions") from None
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ModelFileError(f"{self.path}: shard(s) listed in the index are missing: {', '.join(missing)}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")):
                raise ModelFileError(f"{self.path} holds only pickle weights (.bin/.pt), which bonsai never "
                                     "loads: convert them to safetensors")
            raise ModelFileError(f"{self.path} has no *.safetensors weights")
        return files

    def model_config(self) -> ModelConfig:
        """The architecture config.json declares, checked against the tensors (engine.sources.model_check)."""
        return checked_config(self.path, self.hf_config, self.tensor_info, canonical_name)

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_hf_dir(self.path)

    def tensor_info(self) -> list[tuple[str, str, tuple[int, ...], int]]:
        """(name, dtype, shape, bytes) of every tensor."""
        from safetensors import safe_open
        out = []
        for file in self.weight_files:
            with _open(file, safe_open) as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                    dtype = sl.get_dtype()
                    numel = 1
                    for s in shape:
                        numel *= s
                    out.append((name, dtype, shape, numel * _DTYPE_BYTES.get(dtype, 4)))
        return out

    def iter_canonical_tensors(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open
        for file in self.weight_files:
            with _open(file, safe_open) as f:
                for name in f.keys():
                    canon = canonical_name(name)
                    if canon is not None:
                        yield canon, f.get_tensor(name)


_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "F64": 8, "I16": 2}


class _open:
    """safe_open with a one-line error for corrupt files."""

    def __init__(self, file: Path, safe_open: Any):
        self.file, self.safe_open, self.handle = file, safe_open, None

    def __enter__(self) -> Any:
        try:
            self.handle = self.safe_open(str(self.file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelFileError(f"{self.file} is not a valid safetensors file ({str(e).splitlines()[0]})") from None
        return self.handle.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.handle.__exit__(*exc)
