"""On the CPU, the block matrices of a GGUF loaded as stored, never decoded to floats, by one of two kernel sets
(runtime.cpu_kernels):
  native  bonsai's compiled kernels (engine.runtime.cpu_kquant): Q4_K, Q6_K, Q4_0/1, Q5_0/1, Q8_0 at their stored
          size, int8 activations (llama.cpp's arithmetic); needs a C compiler, chosen by `auto` where its
          vector bodies compile (AVX512-VNNI or AVX2 + FMA + F16C).
  torch   torch's int4 kernel (engine.runtime.cpu_int4): Q4_0, Q4_1, Q4_K (Q5_0, Q5_1 and Q8_0 as two 4-bit halves),
          bfloat16 activations; Q6_K matrices stay float.
A fused layer (q/k/v, gate/up) qualifies when every part it stacks does; the output layer stays float32 (exact
logits, or engine.runtime.narrow_head's fast head)."""
from __future__ import annotations

import logging

import torch

from engine.pipeline.naming import global_name, local_name, stage_holds
from engine.errors import BonsaiError, UnsupportedModelError
from engine.runtime.cpu_int4 import Int4CpuLinear, int4_kernel_available
from engine.runtime.cpu_kquant import KQuantCpuLinear, KQuantHead
from engine.runtime.cpu_step import attach_native_steps
from engine.sources.model_config import ModelConfig
from engine.weights.formats import linear_modules
from quant import kquant_pack
from quant.gguf_int4 import widen
from quant.kernels import cpu_rt

log = logging.getLogger(__name__)


def resolve_cpu_kernels(setting: str) -> str:
    """runtime.cpu_kernels → the set that runs: auto is native where its vector bodies compiled, else torch;
    native without a working compiler is an error that says how to fix it."""
    if setting == "torch":
        return "torch"
    if setting == "auto":
        return "native" if cpu_rt.vector() else "torch"
    if cpu_rt.library() is None:
        raise BonsaiError(f"config runtime.cpu_kernels: native needs a C compiler: {cpu_rt.build_error()}; "
                          "or use cpu_kernels: torch")
    if not cpu_rt.vector():
        log.warning("native CPU kernels without AVX512-VNNI or AVX2 on this CPU: the portable C loops run (slow)")
    return "native"


def cpu_int4_layers(source, config: ModelConfig, stage=None, kernels: str = "torch") -> dict[str, list[str]]:
    """{Linear module (global name): the canonical tensors it stacks} of the layers `pack_cpu_int4`
    loads as stored by `kernels` (resolve_cpu_kernels): every part stored in a type they read, the output
    layer excluded."""
    if kernels == "native":
        if not hasattr(source, "block_type"):
            return {}
        found = {name for name in source.canonical_names() if source.block_type(name) in kquant_pack.PACKABLE}
    elif not hasattr(source, "int4_tensors") or not int4_kernel_available():
        return {}
    else:
        found = source.int4_tensors(config)
    return {path: parts for path, _, _, parts in linear_modules(config)
            if path != "lm_head" and all(p in found for p in parts) and stage_holds(stage, config, path)}


@torch.no_grad()
def pack_cpu_int4(model, source, config: ModelConfig, layers: dict[str, list[str]], kernels: str = "torch") -> None:
    """Swap each layer in `layers` (left unallocated by the loader) for a KQuantCpuLinear (native) or an
    Int4CpuLinear (torch) made from its parts' stored blocks, one layer at a time (the bias, loaded as a float
    tensor, is kept)."""
    for path, parts in layers.items():
        local = local_name(path, model.first_layer)
        module = model.get_submodule(local)
        n, k = module.weight.shape
        bias = module.bias.data if module.bias is not None else None
        parent, _, attr = local.rpartition(".")
        if kernels == "native":
            packed = [source.read_packed(name, config) for name in parts]
            if any(p is None for p in packed):  # a Q8_0 / Q5_0 scale whose offset overflows fp16 (never seen)
                raise UnsupportedModelError(f"{path}: its stored scales do not fit the native CPU kernels; "
                                            "use runtime.cpu_kernels: torch")
            assert sum(p.n for p in packed) == n and packed[0].k == k, f"{path}: stored vs module {(n, k)}"
            setattr(model.get_submodule(parent) if parent else model, attr, KQuantCpuLinear(packed, bias))
            continue
        decoded = [source.read_int4(name, config) for name in parts]
        if len({d[0].shape[1] for d in decoded}) > 1:  # 4-bit parts stacked with two-half (wider) ones
            decoded = [d if d[0].shape[1] == 2 * k else widen(*d) for d in decoded]
        codes, s, z = (torch.cat([d[i] for d in decoded]) for i in range(3))  # [N, K'], [N, K'/32], [N, K'/32]
        assert codes.shape[0] == n and codes.shape[1] in (k, 2 * k), \
            f"{global_name(local, model.first_layer)}: stored {tuple(codes.shape)}, module {(n, k)}"
        setattr(model.get_submodule(parent) if parent else model, attr, Int4CpuLinear(codes, s, z, bias, k))
    if kernels == "native":  # each block's decode rows in one C call where it can (engine.runtime.cpu_step)
        attach_native_steps(model)
    if layers:
        log.info("%d matrices run as stored (%s CPU kernels)", len(layers), kernels)


@torch.no_grad()
def native_head(model, source, config: ModelConfig) -> bool:
    """On the native kernels, an output layer (or tied embedding) stored in a block type runs as stored with its top
    logits exact (engine.runtime.cpu_kquant.KQuantHead) instead of a float one narrowed; False where it is not."""
    name = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
    if not hasattr(source, "block_type") or source.block_type(name) not in kquant_pack.PACKABLE:
        return False
    if model.lm_head is not None and (type(model.lm_head).__name__ != "Linear" or model.lm_head.weight.is_meta):
        return False
    packed = source.read_packed(name, config)
    if packed is None or packed.k % 32:
        return False
    bias = None if model.lm_head is None or model.lm_head.bias is None else model.lm_head.bias.data
    model.lm_head = KQuantHead(packed, bias)
    return True

