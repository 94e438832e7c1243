"""Run-time weight formats: their names, and the one rule of which linear layer gets which format.

Every linear layer of the model (`linear_modules`: q/k/v fused, o, gate/up fused, down, and an
untied output layer) runs either in float (the loaded weights, in the weight dtype) or as packed
low-bit codes in one of quant.packed_layout's layout kinds, with a group size. `linear_formats` is
the rule, used by the memory plan before loading and by the loader while loading:
  1. a layer whose stored parts are all quantized in one layout kind and group (a bonsai
     checkpoint, a TQ1_0 / TQ2_0 / Q1_0 / Q2_0 GGUF) and which packs at its shape keeps those codes
     (`stored_formats` reads them from metadata; engine.weights.packed_load repacks them);
  2. any other layer is rounded at load to the run's `WeightFormat`: `quant_type` for the blocks
     (`sensitive_type` for those `sensitive_layers` names), `head_type` for the output layer (a tied one
     gets its own packed copy), float for bf16 — except a
     hybrid's DeltaNet gate projections in_proj_a / in_proj_b (one row per value head), which stay float
     (as `bonsai quantize` keeps them: engine.quantization.calibration).
Ternary matrices, stored or rounded, run in the 2-bit `tri` layout or, with `ternary_layout: base3`, in
`tri5` where K is a multiple of 256 (the same codes and scales: a re-layout, never a re-rounding).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import BonsaiError, GroupSizeError
from engine.sources.checkpoint_file import BonsaiCheckpoint, canonical_name
from engine.sources.gguf_file import GGUFFile
from engine.sources.hf_files import hf_name
from engine.sources.model_config import ModelConfig
from quant import gguf_codec, gguf_types
from quant.packed_layout import KINDS, check_packable

WEIGHT_TYPES = ("bf16", *KINDS)  # what a run may ask for: bf16 (float as loaded) or a packed layout kind
GROUP_SIZES = (32, 64, 128, 256)
TERNARY_LAYOUTS = ("auto", "2bit", "base3")
# a stored tensor's quant type (quant.checkpoint, GGUF's importable types) → the layout it runs in
# a hybrid's DeltaNet decay / beta gate projections (one row per value head): float whatever the run's format
FLOAT_LINEARS = (".attention.in_proj_a", ".attention.in_proj_b")
STORED_LAYOUT = {"tri": "tri", "tri-dense": "tri", "bin": "bin", "int4": "int4", "int8": "int8"}


@dataclass(frozen=True)
class WeightFormat:
    """How a run asks for its matrices to be held: the blocks' and the output layer's format, the
    blocks kept at more bits (`sensitive_layers`: regular expressions searched in the layers' Hugging
    Face names, as `bonsai quantize --sensitive-layers` takes them; a fused q/k/v or gate/up matrix is
    sensitive when one of its parts is), and the ternary layout: `2bit` (tri), `base3` (tri5, 17.6%
    fewer bytes, slower kernels on small matrices) or `auto` (the memory plan takes base3 when the 2-bit
    weights would not fit the budget: engine.run.plan)."""
    quant_type: str = "bf16"  # bf16 (the source's float weights) | tri | bin | int4 | int8
    group_size: int = 128
    head_type: str = "bf16"  # the output layer: bf16 | int4 | int8 | tri | bin
    sensitive_layers: tuple[str, ...] = ()
    sensitive_type: str = "int4"
    ternary_layout: str = "auto"  # auto | 2bit | base3

    def __post_init__(self) -> None:
        for key in ("quant_type", "head_type", "sensitive_type"):
            if getattr(self, key) not in WEIGHT_TYPES:
                raise BonsaiError(f"unknown weight type '{getattr(self, key)}' for {key}: "
                                  f"use one of {', '.join(WEIGHT_TYPES)}")
        if self.group_size not in GROUP_SIZES:
            raise BonsaiError(f"group size {self.group_size} is not supported: use 32, 64, 128 or 256")
        if self.ternary_layout not in TERNARY_LAYOUTS:
            raise BonsaiError(f"unknown ternary layout '{self.ternary_layout}': use one of {', '.join(TERNARY_LAYOUTS)}")
        for pattern in self.sensitive_layers:
            try:
                re.compile(pattern)
            except re.error as e:
                raise BonsaiError(f"sensitive layer pattern {pattern!r} is not a valid regular expression ({e})") from None

    @property
    def packed(self) -> bool:
        return self.quant_type != "bf16" or self.head_type != "bf16" or bool(self.sensitive_layers)

    @property
    def ternary_kind(self) -> str:
        """The layout ternary matrices run in: tri5 with base3, tri otherwise (auto before the plan decides)."""
        return "tri5" if self.ternary_layout == "base3" else "tri"

    def kind(self, asked: str) -> str:
        """The layout kind of a matrix asked to be `asked` (tri → this run's ternary layout)."""
        return self.ternary_kind if asked == "tri" else asked

    def is_sensitive(self, parts: list[str]) -> bool:
        """Whether a matrix stacking these canonical tensors is kept at sensitive_type."""
        return any(re.search(p, hf_name(part)) for p in self.sensitive_layers for part in parts)


@dataclass(frozen=True)
class LinearFormat:
    """How one linear layer is held at run time: 'float' or a packed layout kind with its group."""
    kind: str = "float"
    group_size: int = 0

    @property
    def packed(self) -> bool:
        return self.kind != "float"

    @property
    def label(self) -> str:
        return f"{self.kind} g{self.group_size}" if self.packed else "float"


def linear_modules(config: ModelConfig) -> list[tuple[str, int, int, list[str]]]:
    """(module path, out_features, in_features, canonical tensor names it stacks) of every linear
    layer of engine.runtime.model.Transformer (the output layer only when untied), by global name."""
    h, f, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    out = []
    for i in range(config.num_layers):
        p = f"layers.{i}"
        if config.is_linear(i):  # a hybrid's DeltaNet layer (engine.runtime.deltanet)
            shapes = config.layer_linear_shapes(i)
            out += [(f"{p}.attention.{n}", *shapes[n], [f"{p}.{n}.weight"])
                    for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")]
        else:
            out += [(f"{p}.attention.wqkv", config.q_rows + 2 * kv, h,
                     [f"{p}.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")]),
                    (f"{p}.attention.wo", h, q, [f"{p}.o_proj.weight"])]
        out += [(f"{p}.feed_forward.w13", 2 * f, h, [f"{p}.gate_proj.weight", f"{p}.up_proj.weight"]),
                (f"{p}.feed_forward.w2", h, f, [f"{p}.down_proj.weight"])]
    if not config.tie_word_embeddings:
        out.append(("lm_head", config.vocab_size, h, ["lm_head.weight"]))
    return out


def packable(kind: str, n: int, k: int, group: int) -> bool:
    """Whether an [n, k] matrix packs as `kind` with this group."""
    try:
        check_packable(kind, n, k, group)
    except ValueError:
        return False
    return True


def require_packable(kind: str, n: int, k: int, group: int) -> None:
    """One line when an [n, k] matrix cannot be packed as `kind` with this group (before anything loads)."""
    try:
        check_packable(kind, n, k, group)
    except ValueError as e:
        raise GroupSizeError(f"cannot pack a [{n}, {k}] matrix as {kind}: {e}") from None


def module_parts(path: str) -> list[str]:
    """The canonical tensor names a linear module (by global name) stacks: linear_modules' parts."""
    if path == "lm_head":
        return ["lm_head.weight"]
    prefix, _, name = path.rpartition(".")
    layer = prefix.split(".")[1]
    stacked = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",), "w13": ("gate_proj", "up_proj"),
               "w2": ("down_proj",)}
    return [f"layers.{layer}.{part}.weight" for part in stacked.get(name, (name,))]


def rounded_format(path: str, fmt: WeightFormat) -> LinearFormat:
    """Rule 2: the format a layer still in float is rounded to at load (by global name; the output layer:
    head_type; a sensitive block matrix: sensitive_type; ternary in the run's ternary layout)."""
    if path.endswith(FLOAT_LINEARS):
        return LinearFormat()
    if path == "lm_head":
        kind = fmt.head_type
    else:
        kind = fmt.sensitive_type if fmt.is_sensitive(module_parts(path)) else fmt.quant_type
    return LinearFormat() if kind == "bf16" else LinearFormat(fmt.kind(kind), fmt.group_size)


def linear_formats(config: ModelConfig, fmt: WeightFormat = WeightFormat(),
                   stored: dict[str, tuple[str, int]] | None = None) -> dict[str, LinearFormat]:
    """The run-time format of every linear layer (the module doc's rule), by global module name.
    stored: canonical tensor name → (layout kind, group) of the tensors kept packed as stored
    (`stored_formats`; empty or None when the run does not keep stored codes)."""
    formats: dict[str, LinearFormat] = {}
    modules = linear_modules(config)
    blocks = [hf_name(p) for path, _, _, parts in modules if path != "lm_head" and not path.endswith(FLOAT_LINEARS)
              for p in parts]
    for pattern in fmt.sensitive_layers:
        if not any(re.search(pattern, name) for name in blocks):
            roles = sorted({name.split(".")[-2] for name in blocks})
            raise BonsaiError(f"sensitive layer pattern {pattern!r} matches no layer; the layers are {', '.join(roles)}")
    for path, n, k, parts in modules:
        layer = LinearFormat()
        if stored:
            found = [stored.get(p) for p in parts]
            if all(found) and len(set(found)) == 1 and packable(found[0][0], n, k, found[0][1]):
                layer = LinearFormat(*found[0])
                if layer.kind == "tri" and packable(fmt.ternary_kind, n, k, layer.group_size):
                    layer = LinearFormat(fmt.ternary_kind, layer.group_size)  # the same codes, re-laid out
        if not layer.packed:
            layer = rounded_format(path, fmt)
            if layer.kind == "tri5" and not packable("tri5", n, k, layer.group_size):
                layer = LinearFormat("tri", layer.group_size)  # base-3 needs K a multiple of 256
            if layer.packed:
                require_packable(layer.kind, n, k, layer.group_size)
        formats[path] = layer
    head = rounded_format("lm_head", fmt)
    if config.tie_word_embeddings and head.packed:
        require_packable(head.kind, config.vocab_size, config.hidden_size, head.group_size)
        formats["lm_head"] = head
    return formats


def stored_formats(source, exact: bool = False) -> dict[str, tuple[str, int]]:
    """canonical tensor name → (packed layout kind, group) of the tensors a source stores quantized
    in a form the loader keeps packed (engine.weights.packed_load), read from metadata only. exact:
    leave out GGUF Q2_0 tensors, whose layout (tri or int4) depends on their codes."""
    out: dict[str, tuple[str, int]] = {}
    if isinstance(source, BonsaiCheckpoint):
        for name, entry in source.checkpoint.entries.items():
            canon = canonical_name(name)
            if canon is not None and not entry.is_float and entry.quant_type in STORED_LAYOUT:
                out[canon] = (STORED_LAYOUT[entry.quant_type], entry.group_size)
    elif isinstance(source, GGUFFile):
        # Q2_0 runs as tri or int4 depending on its codes (the data): planned as int4, the larger
        importable = {gguf_types.type_name(i): ({"tri-dense": "tri", "q2_0": "int4"}.get(q, q), gguf_codec.BLOCKS[i][0])
                      for i, q in gguf_codec.IMPORTABLE.items()}
        q2_names = {gguf_types.type_name(i) for i, q in gguf_codec.IMPORTABLE.items() if q == "q2_0"}
        for name, type_name, shape, _ in source.tensor_info():
            canon = source.canonical(name)
            if canon is not None and type_name in importable and len(shape) == 2 \
                    and source.keeps_codes(canon, importable[type_name][1]):
                if not (exact and type_name in q2_names):
                    out[canon] = importable[type_name]
    return out
