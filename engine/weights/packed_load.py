"""Quantized tensors of a checkpoint or GGUF → the packed runtime layouts, without requantizing.

A bonsai checkpoint (and a GGUF of TQ1_0 / TQ2_0 / Q1_0 / Q2_0 tensors) stores integer codes and
group scales; the kernels' layouts hold the same codes, so loading them is a repack: the values the
kernels multiply are exactly the stored ones. Fused projections (q/k/v, gate/up) are packed
together when their parts share a layout kind and group size; otherwise they stay float.
"""
from __future__ import annotations

import logging

import torch

from engine.pipeline.naming import global_name, layer_index, local_name
from engine.runtime.model import Linear, Transformer
from engine.weights.formats import STORED_LAYOUT, linear_modules, packable
from engine.weights.packed_linear import PackedLinear
from quant.packed_layout import check_packable, pack

log = logging.getLogger(__name__)


def _targets(model: Transformer) -> list[tuple[str, list[str]]]:
    """(module path in `model`, canonical tensor names whose rows it stacks) of the linear layers the
    model holds (a pipeline stage's: its layers from first_layer, the output layer on the last)."""
    first, end = model.first_layer, model.first_layer + len(model.layers)
    out = []
    for path, _, _, parts in linear_modules(model.config):
        held = (first <= int(path.split(".")[1]) < end if path.startswith("layers.")
                else model.lm_head is not None and model.gives_logits)
        if held:
            out.append((local_name(path, first), parts))
    return out


def pack_stored_codes(model: Transformer, source, config, device: torch.device | None = None,
                      host_layers: frozenset[int] = frozenset(), ternary: str = "tri") -> set[str]:
    """Swap every Linear whose source tensors are stored quantized for a PackedLinear holding those
    codes, on `device` (default: the layer's; a layer may have an unallocated meta weight). The
    source's tensors are read one at a time and a layer is packed as soon as its last part arrives:
    host memory holds the codes of the layers still incomplete, never the whole model's. Returns
    the names of the layers packed. host_layers: the layers of these blocks are packed in host memory.
    ternary: the layout ternary codes run in (tri, or tri5 where the shape allows: the same codes)."""
    if not hasattr(source, "iter_quantized_tensors"):
        return set()
    targets = dict(_targets(model))
    module_of = {name: path for path, names in targets.items() for name in names}
    pending: dict[str, dict[str, tuple]] = {}
    packed: set[str] = set()
    for name, qt, g, codes, scales in source.iter_quantized_tensors(config):
        path = module_of.get(name)
        if path is None:
            continue
        parts = pending.setdefault(path, {})
        parts[name] = (qt, g, codes, scales)
        if len(parts) < len(targets[path]):
            continue
        del pending[path]
        where = device
        if host_layers and layer_index(global_name(path, model.first_layer)) in host_layers:
            where = torch.device("cpu")
        if _pack_layer(model, path, [parts[n] for n in targets[path]], where, ternary):
            packed.add(path)
    return packed


def _pack_layer(model: Transformer, path: str, parts: list[tuple], device: torch.device | None,
                ternary: str = "tri") -> bool:
    """Pack one layer from its parts' (quant type, group, codes [n, K], scales [n, K/G]) if they share
    a layout kind and group size and the shape is packable; else leave it float (and say why)."""
    kinds = {STORED_LAYOUT.get(p[0]) for p in parts}
    groups = {p[1] for p in parts}
    if len(kinds) != 1 or None in kinds or len(groups) != 1:
        log.info("%s: parts stored as %s; kept in float", path, sorted(str(p[0]) for p in parts))
        return False
    kind, group = kinds.pop(), groups.pop()
    codes = torch.cat([p[2] for p in parts])  # [N, K]
    scales = torch.cat([p[3] for p in parts])  # [N, K/G]
    if kind == "tri" and ternary == "tri5" and packable("tri5", codes.shape[0], codes.shape[1], group):
        kind = "tri5"
    try:
        check_packable(kind, codes.shape[0], codes.shape[1], group)
    except ValueError as e:
        log.info("%s: %s; kept in float", path, e)
        return False
    module: Linear = model.get_submodule(path)
    bias = module.bias.data if module.bias is not None else None
    pw = pack(kind, codes, scales, group).to(device if device is not None else module.weight.device)
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, PackedLinear(pw, bias))
    return True
