"""A draft model on the CPU with every matrix as 4-bit codes: the cheapest drafted token this CPU can make.

On a CPU a decode step costs its matrices' bytes and dot products, and a drafter pays only if its token costs a
small part of the target's. The 0.5B Qwen2.5-Coder drafting for the 1.5B, as its GGUF stores it (Q5_0 / Q8_0 as
two 4-bit halves, Q6_K matrices as float16, a float32 output layer narrowed to int8), cost 0.4-0.5 of a target
step; with every matrix on torch's int4 kernel it costs ~0.2 (docs/perf.md, session 23). A drafter's weights
need not be exact: verification keeps the output exact, its rounding only lowers acceptance a little (greedy
agreement with the 1.5B on the coder suite 0.917 → 0.896).

Matrices already stored in a 4-bit type stay as they are; the wider ones (two-half codes, float matrices, the
output layer, tied or not) are rounded to the kernel's form, one affine pair per 32 weights
(quant.gguf_int4.affine_rtn). Packed (bonsai-quantized) layers are left alone. A drafter loaded for the native
CPU kernels (engine.runtime.cpu_kquant) is rounded the same way into their 4-bit form (a4: 5 bits a weight), its
Q4_K matrices kept as stored.
"""
from __future__ import annotations

import torch

from engine.runtime.cpu_int4 import Int4CpuLinear, int4_kernel_available
from engine.runtime.cpu_kquant import KQuantCpuLinear
from engine.runtime.linear import Linear
from engine.weights.loader import LoadedModel
from quant import kquant_pack
from quant.gguf_int4 import GROUP, affine_rtn

ROW_MULTIPLE = 16  # the int4 kernel packs rows in sixteens


def _convertible(module: torch.nn.Module) -> bool:
    if isinstance(module, Int4CpuLinear):
        return module.halves == 2
    weight = getattr(module, "weight", None)
    return type(module) is Linear and weight is not None and weight.dtype.is_floating_point and weight.dim() == 2


def _fits(out_features: int, in_features: int) -> bool:
    return in_features % GROUP == 0 and out_features % ROW_MULTIPLE == 0


@torch.no_grad()
def _as_int4(module: torch.nn.Module) -> Int4CpuLinear:
    weight = module.dequantized() if isinstance(module, Int4CpuLinear) else module.weight.data.float()  # [N, K]
    codes, s, z = affine_rtn(weight)  # [N, K], [N, K/32] x 2
    bias = module.bias.data if module.bias is not None else None
    return Int4CpuLinear(codes, s, z, bias, weight.shape[1])


def _as_a4(weight: torch.Tensor, bias: torch.Tensor | None) -> KQuantCpuLinear:
    codes, s, z = affine_rtn(weight.float())  # [N, K], [N, K/32] x 2
    return KQuantCpuLinear([kquant_pack.from_affine(codes.numpy(), s.numpy(), z.numpy())], bias)


@torch.no_grad()
def _native_drafter(model) -> int:
    """four_bit_drafter for a model on the native CPU kernels: every matrix not already 4-bit becomes a4."""
    done = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, KQuantCpuLinear):
            if set(module.kinds) <= {"a4", "q4k"}:
                continue
            weight = module.dequantized()  # [N, K]
        elif _convertible(module) and module.weight.shape[1] % GROUP == 0:
            weight = module.weight.data  # [N, K]
        else:
            continue
        parent, _, attr = name.rpartition(".")
        bias = module.bias.data if module.bias is not None else None
        setattr(model.get_submodule(parent) if parent else model, attr, _as_a4(weight, bias))
        done += 1
    if model.lm_head is None and model.embed.weight.shape[1] % GROUP == 0:  # tied: the embedding stays for lookups
        model.lm_head = _as_a4(model.embed.weight.data, None)
        done += 1
    return done


@torch.no_grad()
def four_bit_drafter(loaded: LoadedModel) -> int:
    """Round `loaded`'s (a draft model's) matrices to 4-bit codes in place, where it runs on a CPU with torch's
    int4 kernel or the native kernels (as it was loaded); the number of matrices rounded (0: nothing to do here)."""
    if loaded.device.type != "cpu":
        return 0
    if loaded.cpu_kernels == "native":
        return _native_drafter(loaded.model)
    if not int4_kernel_available():
        return 0
    model = loaded.model
    done = 0
    for name, module in list(model.named_modules()):  # the block matrices and an untied output layer
        if name and _convertible(module) and _fits(*module_shape(module)):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, _as_int4(module))
            done += 1
    if model.lm_head is None:  # tied: the output layer reads the embedding, which stays for the lookup
        vocab, hidden = model.embed.weight.shape
        if _fits(vocab, hidden):
            codes, s, z = affine_rtn(model.embed.weight.data.float())  # [V, H], [V, H/32] x 2
            model.lm_head = Int4CpuLinear(codes, s, z, None, hidden)
            done += 1
    return done


def module_shape(module: torch.nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a dense or int4 layer."""
    if isinstance(module, Int4CpuLinear):
        return module.out_features, module.in_features
    return tuple(module.weight.shape)  # type: ignore[return-value]
