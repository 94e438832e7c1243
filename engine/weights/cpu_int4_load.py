"""On the CPU, the block matrices a GGUF stores in a 4-bit type (Q4_0, Q4_1, Q4_K; Q5_0, Q5_1 and Q8_0 as two
4-bit halves) loaded as stored into engine.runtime.cpu_int4's layers: never decoded to floats, 4.5 (9) bits a
weight read per token instead of float16's 16. A fused layer (q/k/v, gate/up) qualifies when every part it stacks does; the output layer
stays float32 (exact logits)."""
from __future__ import annotations

import logging

import torch

from engine.pipeline.naming import global_name, local_name, stage_holds
from engine.runtime.cpu_int4 import Int4CpuLinear, int4_kernel_available
from engine.sources.model_config import ModelConfig
from engine.weights.formats import linear_modules
from quant.gguf_int4 import widen

log = logging.getLogger(__name__)


def cpu_int4_layers(source, config: ModelConfig, stage=None) -> dict[str, list[str]]:
    """{Linear module (global name): the canonical tensors it stacks} of the layers `pack_cpu_int4`
    loads from 4-bit codes: every part stored in a type it reads, the output layer excluded."""
    if not hasattr(source, "int4_tensors") or not int4_kernel_available():
        return {}
    found = source.int4_tensors(config)
    return {path: parts for path, _, _, parts in linear_modules(config)
            if path != "lm_head" and all(p in found for p in parts) and stage_holds(stage, config, path)}


@torch.no_grad()
def pack_cpu_int4(model, source, config: ModelConfig, layers: dict[str, list[str]]) -> None:
    """Swap each layer in `layers` (left unallocated by the loader) for an Int4CpuLinear made from its
    parts' stored codes, one layer at a time (the bias, loaded as a float tensor, is kept)."""
    for path, parts in layers.items():
        local = local_name(path, model.first_layer)
        module = model.get_submodule(local)
        n, k = module.weight.shape
        decoded = [source.read_int4(name, config) for name in parts]
        if len({d[0].shape[1] for d in decoded}) > 1:  # 4-bit parts stacked with two-half (wider) ones
            decoded = [d if d[0].shape[1] == 2 * k else widen(*d) for d in decoded]
        codes, s, z = (torch.cat([d[i] for d in decoded]) for i in range(3))  # [N, K'], [N, K'/32], [N, K'/32]
        assert codes.shape[0] == n and codes.shape[1] in (k, 2 * k), \
            f"{global_name(local, model.first_layer)}: stored {tuple(codes.shape)}, module {(n, k)}"
        bias = module.bias.data if module.bias is not None else None
        parent, _, attr = local.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, Int4CpuLinear(codes, s, z, bias, k))
    if layers:
        log.info("%d matrices run as their stored 4-bit codes (CPU int4 kernel)", len(layers))
