"""Quantization with calibration data: sequential, layer-wise GPTQ (and GSQ refinement) over the model.

The calibration sequences are embedded once; then, block after block, the inputs of the block's four
linear groups are collected by running the block (q/k/v: the attention_norm output; o: the attention
output; gate/up: the ffn_norm output; down: the SwiGLU output, after a rotated model's online
Hadamard), their Hessians H = Σ xᵀx accumulated, the weights quantized and written back
(dequantized) into the model, in that order inside the block, so that every later input is computed
by the already quantized model ("true sequential" GPTQ). A block's tensors are yielded as soon as
they are done. The output layer is quantized with GPTQ on the final-norm outputs (always GPTQ, also
for method gsq: its vocabulary-sized logits would cost GSQ too much). The embedding, a gather with no Hessian, is rounded to nearest first, unless it is tied to the
output layer: then it is quantized last, as the output layer (on SmolLM2-135M, int4 g64 of the tied
embedding alone: ppl 14.70 → 17.61 by rtn, → 15.44 by GPTQ; mean KL 0.179 → 0.044).

Memory: besides the model, the calibration state is one block's activations for the whole set, at
the widest point the residual stream twice (in and out) next to the down projection's inputs:
tokens × (2 · hidden + intermediate) × 4 bytes (float32 activations), plus one Hessian (in² × 8 bytes)
at a time, plus, for gsq, `gsq_tokens` input rows per layer and GSQ's own state (about 20 floats per
weight of the layer). 64 × 256 tokens of SmolLM2-135M: about 180 MB.
Blocks are moved to `device` one at a time (and back), so a GPU holds one block plus that state.
The model is modified in place: afterwards it holds the dequantized weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from engine.errors import BonsaiError
from engine.weights.loader import LoadedModel, resolve_device
from engine.runtime.deltanet import GatedDeltaNet
from engine.runtime.model import Block
from engine.quantization.block_pass import (CROSS_DTYPE, FloatStream, attention_input, block_forward, out_proj,
                                            rotary_tables, swiglu)
from quant.grids import dequantize
from quant.formats import fp16_scales, relative_error
from quant.gptq import GRIDS, asymmetric_target, gptq_with_refits, hessian_dtype, rtn
from quant.gsq import GSQOptions, gsq_refine

METHODS = ("gptq", "gsq")
FLOAT_TYPES = ("bf16", "f16", "f32", "float")  # a spec with one of these keeps the tensor in float


@dataclass(frozen=True)
class CalibrationOptions:
    samples: int = 128  # calibration sequences used (the first `samples` given)
    seq_len: int = 256  # each sequence is cut to this many tokens
    damp: float = 0.01  # GPTQ: λ = damp · mean diag(H)
    block_size: int = 128  # GPTQ lazy-update block
    act_order: bool = False  # GPTQ: columns by decreasing H[i, i] (groups stay contiguous)
    scale_refits: int = 0  # after GPTQ: rounds of least-squares group scales (quant.gptq.gptq_with_refits)
    asymmetric: float = 0.0  # layer-wise loop: share of the float model's target (quant.gptq.asymmetric_target)
    gsq: GSQOptions = field(default_factory=GSQOptions)
    gsq_tokens: int = 16384  # input rows per layer given to GSQ (a random subsample when there are more)
    device: str = "cpu"
    batch_sequences: int = 8  # sequences per forward pass
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("samples", "seq_len", "block_size", "gsq_tokens", "batch_sequences"):
            if int(getattr(self, name)) < 1:
                raise BonsaiError(f"calibration option {name} must be >= 1, got {getattr(self, name)}")
        if int(self.scale_refits) < 0:
            raise BonsaiError(f"calibration option scale_refits must be >= 0, got {self.scale_refits}")
        if self.seq_len < 2:
            raise BonsaiError(f"calibration sequences need at least 2 tokens, got seq_len {self.seq_len}")
        if not self.damp > 0:
            raise BonsaiError(f"calibration option damp must be > 0, got {self.damp}")
        if not 0 <= self.asymmetric <= 1:
            raise BonsaiError(f"--asymmetric must be between 0 and 1, got {self.asymmetric}")
        if not isinstance(self.gsq, GSQOptions):
            raise BonsaiError("calibration option gsq must be a GSQOptions")


def calibration_sequences(token_ids: list[int], samples: int, seq_len: int) -> list[list[int]]:
    """Cut one token stream into up to `samples` non-overlapping windows of `seq_len` tokens, spread
    evenly over the whole text when it holds more than that."""
    available = len(token_ids) // seq_len
    if available == 0:
        raise BonsaiError(f"the calibration text has {len(token_ids)} tokens, fewer than one sequence of "
                          f"{seq_len}: give a longer text or a smaller --calib-seq-len")
    starts = sorted({round(i * available / min(samples, available)) * seq_len for i in range(min(samples, available))})
    return [token_ids[s:s + seq_len] for s in starts]


@dataclass
class Target:
    """One HF tensor that lives in `param[start:start + rows]` of the engine's (possibly fused) weight."""
    name: str
    param: torch.Tensor
    start: int
    rows: int
    spec: Any
    error: tuple[float, float] | None = None  # (Σ (w - ŵ)², Σ w²) once quantized
    sums: tuple | None = None  # once quantized: Σ code·w [N, K/G], Σ code² [N, K/G] (float64), Σ w² (weight_error)


def block_targets(block: Block, layer: int, cfg, plan) -> dict[str, list[Target]]:
    """The block's quantized tensors by the input they share: qkv, o, gate_up, down."""
    p = f"model.layers.{layer}."
    attn, ffn = block.attention, block.feed_forward
    f, q = cfg.intermediate_size, cfg.q_rows
    if cfg.is_linear(layer):  # a DeltaNet layer: in_proj_b / in_proj_a (one row per head) stay float
        hc = cfg.hybrid
        attention = {"qkv": [("linear_attn.in_proj_qkv", attn.in_proj_qkv.weight, 0, hc.conv_dim),
                             ("linear_attn.in_proj_z", attn.in_proj_z.weight, 0, hc.value_dim)],
                     "o": [("linear_attn.out_proj", attn.out_proj.weight, 0, cfg.hidden_size)]}
    else:
        attention = {"qkv": [("self_attn.q_proj", attn.wqkv.weight, 0, q),
                             ("self_attn.k_proj", attn.wqkv.weight, q, cfg.kv_size),
                             ("self_attn.v_proj", attn.wqkv.weight, q + cfg.kv_size, cfg.kv_size)],
                     "o": [("self_attn.o_proj", attn.wo.weight, 0, cfg.hidden_size)]}
    groups = {
        **attention,
        "gate_up": [("mlp.gate_proj", ffn.w13.weight, 0, f), ("mlp.up_proj", ffn.w13.weight, f, f)],
        "down": [("mlp.down_proj", ffn.w2.weight, 0, cfg.hidden_size)],
    }
    out = {}
    for key, parts in groups.items():
        out[key] = []
        for part, param, start, rows in parts:
            name = f"{p}{part}.weight"
            spec = _checked_spec(plan, name, param.shape[1])
            if spec is not None:
                out[key].append(Target(name, param, start, rows, spec))
    return out


def _checked_spec(plan, name: str, in_features: int):
    spec = plan(name)
    if spec is None or spec.quant_type in FLOAT_TYPES:
        return None
    if spec.quant_type not in GRIDS:
        raise BonsaiError(f"{name}: unknown quant type '{spec.quant_type}' (use one of {', '.join(GRIDS)})")
    if spec.group_size < 1 or in_features % spec.group_size:
        raise BonsaiError(f"{name}: group size {spec.group_size} does not divide its {in_features} input features "
                          f"(use a group size that divides {in_features}, e.g. 64 or 32)")
    return spec


class LayerInputs:
    """Hessian H = Σ xᵀx of one layer input (float32 products summed in quant.gptq.hessian_dtype:
    float64 up to 8192 inputs, else float32), for GSQ the rows of x at fixed token positions, and for
    asymmetric calibration (inputs x_f of the float model given to `add`) the cross term W D,
    D = Σ (x_f − x)ᵀ x: kept as D [K, K], or, for one weight W [N, K] with N < K (`weight`), as W D [N, K]."""

    def __init__(self, width: int, device: torch.device, keep_rows: list[torch.Tensor] | None,
                 weight: torch.Tensor | None = None):
        self.hessian = torch.zeros(width, width, dtype=hessian_dtype(width), device=device)  # [K, K]
        self.keep_rows, self.kept, self.chunk = keep_rows, [], 0
        self.weight = None if weight is None else weight.detach().to(CROSS_DTYPE)  # [N, K], N < K: kept as W D
        self.cross: torch.Tensor | None = None  # D [K, K] or W D [N, K] (float32), once a float input is added

    def add(self, x: torch.Tensor, x_float: torch.Tensor | None = None) -> None:
        x2 = x.reshape(-1, x.shape[-1]).float()  # [B·T, K]
        self.hessian += (x2.T @ x2).to(self.hessian.dtype)
        if x_float is not None:  # the cross term's products in CROSS_DTYPE
            d = torch.sub(x_float.reshape(x2.shape), x2).to(CROSS_DTYPE)  # [B·T, K] (no float32 copy of x_float)
            xs = x2.to(CROSS_DTYPE)  # [B·T, K]
            part = (d @ self.weight.T).T @ xs if self.weight is not None else d.T @ xs  # [N, K] or [K, K]
            del d, xs
            self.cross = part.float() if self.cross is None else self.cross.add_(part)
        if self.keep_rows is not None:
            self.kept.append(x2[self.keep_rows[self.chunk]])
        self.chunk += 1

    def cross_of(self, target: "Target") -> torch.Tensor | None:
        """W D of the target's rows [rows, K] (float weights: call before they are quantized), or None."""
        if self.cross is None:
            return None
        if self.weight is not None:
            return self.cross[target.start:target.start + target.rows]
        rows = target.param[target.start:target.start + target.rows].to(self.cross.device, torch.float32)
        return rows @ self.cross  # [rows, K]

    def rows(self) -> torch.Tensor:
        return torch.cat(self.kept)  # [T_gsq, K]


def quantize_with_calibration(loaded: LoadedModel, token_ids: list[list[int]], plan: Callable[[str], Any],
                              method: str, options: CalibrationOptions,
                              progress: Callable[[str], None] | None = None
                              ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, Any]]:
    """Yields (hf_tensor_name, codes int8 [N, K], scales float32 [N, K/G], spec) for every weight the plan
    quantizes (plan(name) returns an object with .quant_type and .group_size, or None for "keep in
    float"). method "gptq" | "gsq". Codes and scales are on the CPU."""
    if method not in METHODS:
        raise BonsaiError(f"unknown calibration method '{method}': use {' or '.join(METHODS)}")
    if options.asymmetric:  # the model is quantized in place: no float model stays to give the float stream
        raise BonsaiError("asymmetric calibration needs the float model next to the quantized one: "
                          "use the layer-wise loop (bonsai quantize), or asymmetric 0 here")
    sequences = [list(s[:options.seq_len]) for s in token_ids[:options.samples]]
    if not sequences or any(len(s) < 2 for s in sequences):
        raise BonsaiError("calibration needs at least one sequence of 2 or more tokens: give a calibration text")
    say = progress or (lambda message: None)
    device = resolve_device(options.device)
    model, cfg = loaded.model, loaded.config
    home = next(model.parameters()).device
    with torch.no_grad():
        targets = [block_targets(block, i, cfg, plan) for i, block in enumerate(model.layers)]
        embed_spec = _checked_spec(plan, "model.embed_tokens.weight", cfg.hidden_size)
        tied = model.lm_head is None  # the embedding is also the output layer: quantized last, as such
        head = None
        if tied and embed_spec is not None:
            head = Target("model.embed_tokens.weight", model.embed.weight, 0, cfg.vocab_size, embed_spec)
        elif not tied and (head_spec := _checked_spec(plan, "lm_head.weight", cfg.hidden_size)) is not None:
            head = Target("lm_head.weight", model.lm_head.weight, 0, cfg.vocab_size, head_spec)
        if embed_spec is not None and not tied:
            say(f"model.embed_tokens.weight: rtn {embed_spec.quant_type} g{embed_spec.group_size}")
            weight = model.embed.weight
            codes, scales = rtn(weight.float(), embed_spec.quant_type, embed_spec.group_size)
            scales = fp16_scales(scales)  # as stored
            weight.copy_(dequantize(codes, scales, embed_spec.group_size).to(weight.dtype))
            yield "model.embed_tokens.weight", codes.cpu(), scales.cpu(), embed_spec
        # chunks of consecutive sequences of one length, embedded: the residual stream
        chunks: list[list[list[int]]] = []
        for s in sequences:
            if chunks and len(chunks[-1]) < options.batch_sequences and len(chunks[-1][0]) == len(s):
                chunks[-1].append(s)
            else:
                chunks.append([s])
        act_dtype = model.norm.weight.dtype
        hidden = [model.embed(torch.tensor(c, device=home)).to(device=device, dtype=act_dtype) for c in chunks]
        keep = gsq_rows(hidden, options) if method == "gsq" else None
        for i, block in enumerate(model.layers):
            block.to(device)
            hidden = yield from quantize_block(block, hidden, targets[i], keep, method, options, model, say)
            block.to(home)
        if head is not None:
            model.norm.to(device)
            inputs = LayerInputs(cfg.hidden_size, device, None)
            for x in hidden:
                inputs.add(model.norm(x))
            model.norm.to(home)
            yield quantize_rows(head, inputs, "gptq", options, say)


def gsq_rows(hidden: list[torch.Tensor], options: CalibrationOptions) -> list[torch.Tensor]:
    """Fixed random token positions (per chunk, flat indices) whose inputs GSQ trains on."""
    sizes = [x.shape[0] * x.shape[1] for x in hidden]
    gen = torch.Generator().manual_seed(options.seed)
    chosen = torch.randperm(sum(sizes), generator=gen)[:options.gsq_tokens].sort().values
    out, offset = [], 0
    for size in sizes:
        local = chosen[(chosen >= offset) & (chosen < offset + size)] - offset
        out.append(local.to(hidden[0].device))
        offset += size
    return out


def quantize_block(block: Block, hidden: list[torch.Tensor], targets: dict[str, list[Target]],
                    keep, method: str, options: CalibrationOptions, model, say, floats: FloatStream | None = None):
    """Quantize one block stage by stage (generator: yields its tensors, returns the next hidden).
    floats: the float model's pass over the block (float_stream): each linear is then fitted to the float
    model's outputs on its inputs by options.asymmetric's share (quant.gptq.asymmetric_target)."""
    cfg = model.config
    device = hidden[0].device
    tables = {}

    def rope(t: int):
        if t not in tables:
            tables[t] = rotary_tables(model, t, device)
        return tables[t]

    def stage(key: str, width: int, make_inputs: Callable[[int], torch.Tensor],
              make_float: Callable[[int], torch.Tensor] | None, *used: str):
        """Hessian (and with floats the cross term) of one input, then its tensors; the float parts `used` by no
        later stage are dropped before GPTQ runs (its peak)."""
        if targets[key]:
            params = {id(t.param): t.param for t in targets[key]}
            one = next(iter(params.values())) if len(params) == 1 else None
            weight = one if floats is not None and one is not None and one.shape[0] < width else None
            inputs = LayerInputs(width, device, keep, weight)
            for c in range(len(hidden)):
                inputs.add(make_inputs(c), None if floats is None else make_float(c))
        for part in used if floats is not None else ():
            setattr(floats, part, None)
        for target in targets[key]:
            yield quantize_rows(target, inputs, method, options, say)

    norm, ffn_norm = block.attention_norm, block.ffn_norm
    yield from stage("qkv", cfg.hidden_size, lambda c: norm(hidden[c]), lambda c: norm(floats.inputs[c]), "inputs")
    attn_out = [attention_input(block, x, rope) for x in hidden]  # inputs of the output projection
    width = cfg.hybrid.value_dim if isinstance(block.attention, GatedDeltaNet) else cfg.q_size
    yield from stage("o", width, attn_out.__getitem__, lambda c: floats.attention[c], "attention")
    hidden = [x + out_proj(block)(a) for x, a in zip(hidden, attn_out)]  # residual after attention
    del attn_out
    yield from stage("gate_up", cfg.hidden_size, lambda c: ffn_norm(hidden[c]), lambda c: ffn_norm(floats.hidden[c]))
    down_in = [swiglu(block, h) for h in hidden]  # inputs of down_proj
    yield from stage("down", cfg.intermediate_size, lambda c: down_in[c],
                     lambda c: swiglu(block, floats.hidden[c], floats.w13), "hidden", "w13")
    return [h + block.feed_forward.w2(s) for h, s in zip(hidden, down_in)]


def quantize_rows(target: Target, inputs: LayerInputs, method: str, options: CalibrationOptions, say):
    spec, g = target.spec, target.spec.group_size
    say(f"{target.name}: {method} {spec.quant_type} g{g}")
    param = target.param
    device = inputs.hessian.device  # the output layer may stay on the CPU while its Hessian is on the GPU
    w = param[target.start:target.start + target.rows].to(device=device, dtype=torch.float32)  # [N, K]
    cross = inputs.cross_of(target)  # [N, K] or None
    goal = w if cross is None else asymmetric_target(w, cross, inputs.hessian, options.damp, options.asymmetric)
    del cross
    codes, scales = gptq_with_refits(goal, inputs.hessian, spec.quant_type, g, options.damp, options.block_size,
                                     options.act_order, options.scale_refits)
    if method == "gsq":
        codes, scales = gsq_refine(goal, inputs.rows(), codes, scales, spec.quant_type, g, options.gsq)
    del goal
    scales = fp16_scales(scales)  # as stored: later layers calibrate on the weights a reader gets
    target.error = relative_error(w, codes, scales, g)
    target.sums = group_sums(w, codes, g)
    param[target.start:target.start + target.rows] = dequantize(codes, scales, g).to(param.device, param.dtype)
    return target.name, codes.cpu(), scales.cpu(), spec


def group_sums(w: torch.Tensor, codes: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per group, Σ code·w and Σ code² [N, K/G] (float64, CPU), and Σ w²: enough to give the weight error of
    any other scales for the same codes without the float weights (weight_error)."""
    n = w.shape[0]
    c = codes.to(w.device, torch.float32).view(n, -1, group_size)  # [N, K/G, G]
    cw = (c * w.float().view(n, -1, group_size)).sum(-1, dtype=torch.float64)  # [N, K/G]
    cc = c.pow(2).sum(-1, dtype=torch.float64)  # [N, K/G]
    return cw.cpu(), cc.cpu(), float(w.float().pow(2).sum(dtype=torch.float64))


def weight_error(sums: tuple[torch.Tensor, torch.Tensor, float], scales: torch.Tensor) -> tuple[float, float]:
    """(Σ (w − ŵ)², Σ w²) for ŵ = codes × `scales` [N, K/G], from group_sums: Σw² − 2Σ s·cw + Σ s²·cc."""
    cw, cc, ww = sums
    s = scales.double().cpu()  # [N, K/G]
    return max(0.0, ww - 2 * float((s * cw).sum()) + float((s * s * cc).sum())), ww
