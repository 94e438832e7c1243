"""PrismML's folded Hadamard rotation of GGUF weights (`prism.hadamard.*` keys): read, checked, placed.

There is no official document; the keys as the public readers of the Ternary-Bonsai files use them:
`version` u32 = 1, `block_size` u32 b (a power of two), `transform` = "normalized-sylvester-walsh-hadamard",
`axis` = "input-last-dimension", `sign_mode` "explicit" (`sign_widths` i32[]: one per activation width,
`sign_values` i32[] of ±1: their sign vectors concatenated in that order) or "identity" (every sign +1),
`weight_names` (GGUF tensors folded forward), `inverse_weight_names` (the embedding), `gdn_v_grouped` (a
hybrid's ssm_out only). A folded weight W [out, in] computes y = W @ R(x), R(x) = WHT_b(x ⊙ s): x times the
signs of its width, then each block of b elements times H_b/√b (Sylvester's H, symmetric: WHT_b is its own
inverse). An inverse-folded embedding row E'[t] stands for the hidden row WHT_b(E'[t]) ⊙ s. The residual
stream is not rotated: RMSNorm gains apply as usual, before R.

Here the rotation becomes one `InputRotationSpec` per linear layer input (engine.runtime.input_rotation
applies it at run time) and one for the embedding (undone in the table as it is read: a lookup table
has no reason to rotate at run time, and a tied output layer then reads the plain table). Pure: no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import ModelFileError, UnsupportedModelError
from engine.sources.model_config import ModelConfig

PREFIX = "prism.hadamard."
_KEYS = {"version", "block_size", "transform", "axis", "sign_mode", "sign_widths", "sign_values", "weight_names",
         "inverse_weight_names", "gdn_v_grouped"}
TRANSFORM, AXIS = "normalized-sylvester-walsh-hadamard", "input-last-dimension"
_EMBEDDING = "token_embd.weight"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")
# GGUF part → (our linear layer in the block, the parts it computes in one product)
_MODULES = {"attn_q": ("attention.wqkv", ("attn_q", "attn_k", "attn_v")),
            "attn_k": ("attention.wqkv", ("attn_q", "attn_k", "attn_v")),
            "attn_v": ("attention.wqkv", ("attn_q", "attn_k", "attn_v")),
            "attn_output": ("attention.wo", ("attn_output",)),
            "ffn_gate": ("feed_forward.w13", ("ffn_gate", "ffn_up")),
            "ffn_up": ("feed_forward.w13", ("ffn_gate", "ffn_up")),
            "ffn_down": ("feed_forward.w2", ("ffn_down",))}


@dataclass(frozen=True)
class InputRotationSpec:
    """x [.., width] → WHT_block(x ⊙ signs) (signs None: all +1): what a folded layer's input gets."""
    width: int
    block: int
    signs: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        assert self.block >= 1 and self.block & (self.block - 1) == 0 and self.width % self.block == 0, self
        assert self.signs is None or len(self.signs) == self.width


@dataclass(frozen=True)
class PrismHadamard:
    """The `prism.hadamard.*` metadata, checked (`parse`)."""
    block: int
    signs: dict[int, tuple[int, ...]] | None  # width → its sign vector; None: identity (all +1)
    weight_names: tuple[str, ...]
    inverse_names: tuple[str, ...]

    def summary(self) -> dict:
        """What `bonsai info` shows."""
        return {"kind": "prism-hadamard", "block": self.block, "sign_widths": sorted(self.signs or ()),
                "weights": len(self.weight_names), "embedding": bool(self.inverse_names)}

    def spec(self, width: int, what: str, where: str) -> InputRotationSpec:
        """The rotation of an input of `width` (read by `what`), refused where the metadata has none for it."""
        if width % self.block:
            raise UnsupportedModelError(f"{where}: its Hadamard block {self.block} does not divide the width "
                                        f"{width} of {what}'s input; the file is inconsistent, download it again")
        if self.signs is not None and width not in self.signs:
            raise ModelFileError(f"{where}: prism.hadamard.sign_widths {sorted(self.signs)} has no signs for the "
                                 f"width {width} of {what}'s input; the file is corrupt, download it again")
        return InputRotationSpec(width, self.block, None if self.signs is None else self.signs[width])


def parse(metadata: dict, where: str) -> PrismHadamard | None:
    """The rotation a GGUF's metadata declares, None without `prism.hadamard.*` keys; one-line errors."""
    found = {k[len(PREFIX):]: v for k, v in metadata.items() if k.startswith(PREFIX)}
    if not found:
        return None
    unknown = sorted(set(found) - _KEYS)
    if unknown:  # a key we do not know may change what the rotation is: never guess
        raise UnsupportedModelError(f"{where} carries {PREFIX}{unknown[0]}, a Hadamard rotation setting bonsai does "
                                    "not know; use a file without it or a newer bonsai")

    def need(key: str, kind: type, default=None):
        value = found.get(key, default)
        if value is None or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ModelFileError(f"{where}: {PREFIX}{key} is {'missing' if value is None else repr(value)[:40]}, "
                                 f"not {kind.__name__}; the file is corrupt, download it again")
        return value

    version = need("version", int)
    if version != 1:
        raise UnsupportedModelError(f"{where}: {PREFIX}version is {version}; bonsai reads version 1 of the Prism "
                                    "Hadamard rotation: use a newer bonsai or a version-1 file")
    for key, known in (("transform", TRANSFORM), ("axis", AXIS)):
        if need(key, str) != known:
            raise UnsupportedModelError(f"{where}: {PREFIX}{key} is {found[key]!r}; bonsai applies only "
                                        f"{known!r}: use a file with that rotation")
    block = need("block_size", int)
    if block < 1 or block & (block - 1):
        raise ModelFileError(f"{where}: {PREFIX}block_size {block} is not a power of two; the file is corrupt, "
                             "download it again")
    mode = need("sign_mode", str)
    widths, values = need("sign_widths", list, []), need("sign_values", list, [])
    if mode == "identity":
        if widths or values:
            raise ModelFileError(f"{where}: {PREFIX}sign_mode is 'identity' but the file carries sign values; "
                                 "the file is corrupt, download it again")
        signs = None
    elif mode == "explicit":
        signs = _signs(widths, values, where)
    else:
        raise UnsupportedModelError(f"{where}: {PREFIX}sign_mode is {mode!r}; bonsai reads 'explicit' and "
                                    "'identity': use a file with one of those")
    names = [need(k, list, []) for k in ("weight_names", "inverse_weight_names")]
    for key, listed in zip(("weight_names", "inverse_weight_names"), names):
        if not all(isinstance(n, str) for n in listed):
            raise ModelFileError(f"{where}: {PREFIX}{key} holds something other than tensor names; the file is "
                                 "corrupt, download it again")
    if "gdn_v_grouped" in found:
        need("gdn_v_grouped", bool)
    return PrismHadamard(block, signs, tuple(names[0]), tuple(names[1]))


def _signs(widths: list, values: list, where: str) -> dict[int, tuple[int, ...]]:
    if not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths) \
            or len(set(widths)) != len(widths):
        raise ModelFileError(f"{where}: {PREFIX}sign_widths {widths[:8]} are not distinct positive widths; the "
                             "file is corrupt, download it again")
    if len(values) != sum(widths):
        raise ModelFileError(f"{where}: {PREFIX}sign_values holds {len(values)} signs but sign_widths {widths[:8]} "
                             f"need {sum(widths)}; the file is corrupt, download it again")
    bad = next((v for v in values if v not in (1, -1) or isinstance(v, bool)), None)
    if bad is not None:
        raise ModelFileError(f"{where}: {PREFIX}sign_values holds {bad!r}, not +1 or -1; the file is corrupt, "
                             "download it again")
    out, start = {}, 0
    for w in widths:
        out[w] = tuple(int(v) for v in values[start:start + w])
        start += w
    return out


def place(rotation: PrismHadamard, config: ModelConfig, tensor_names: set[str], where: str
          ) -> tuple[dict[str, InputRotationSpec], InputRotationSpec | None]:
    """({linear layer (global module path, engine.weights.formats.linear_modules): its input's rotation},
    the embedding's rotation or None) of a dense model; a name the model cannot place is refused."""
    if config.hybrid is not None:
        raise UnsupportedModelError(f"{where}: a Hadamard-rotated {config.architecture} (hybrid) file is not "
                                    "supported yet: bonsai applies the Prism rotation to llama / qwen2 / qwen3 files")
    for name in (*rotation.weight_names, *rotation.inverse_names):
        if name not in tensor_names:
            raise ModelFileError(f"{where}: {PREFIX}weight_names lists {name}, a tensor the file lacks; the file "
                                 "is corrupt, download it again")
    for name in rotation.inverse_names:
        if name != _EMBEDDING:
            raise UnsupportedModelError(f"{where}: {PREFIX}inverse_weight_names lists {name}; bonsai undoes the "
                                        f"rotation of {_EMBEDDING} only: use a file rotated that way")
    widths = {"attention.wqkv": config.hidden_size, "attention.wo": config.q_size,
              "feed_forward.w13": config.hidden_size, "feed_forward.w2": config.intermediate_size}
    folded = set(rotation.weight_names)
    inputs: dict[str, InputRotationSpec] = {}
    for name in rotation.weight_names:
        if name == "output.weight":
            inputs["lm_head"] = rotation.spec(config.hidden_size, name, where)
            continue
        m = _BLOCK_RE.match(name)
        if m is None or int(m.group(1)) >= config.num_layers:
            raise UnsupportedModelError(f"{where}: {PREFIX}weight_names lists {name}, which bonsai cannot place "
                                        "(it rotates the inputs of the attention and FFN projections and of "
                                        "output.weight); use a file rotated that way")
        module, parts = _MODULES[m.group(2)]
        others = [f"blk.{m.group(1)}.{p}.weight" for p in parts]
        plain = [n for n in others if n not in folded]
        if plain:
            raise UnsupportedModelError(f"{where}: {PREFIX}weight_names lists {name} but not {plain[0]}, which "
                                        "bonsai computes in one product with it from the same input; use a file "
                                        "that rotates both or neither")
        inputs[f"layers.{m.group(1)}.{module}"] = rotation.spec(widths[module], name, where)
    embedding = rotation.spec(config.hidden_size, _EMBEDDING, where) if rotation.inverse_names else None
    return inputs, embedding
