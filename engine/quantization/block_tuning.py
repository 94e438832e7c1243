"""Block-wise scale tuning inside the layer loop: once a decoder block's linears are quantized (codes fixed),
its group scales are trained so that the quantized block's outputs match the float model's on the
calibration sequences.

GPTQ and its scale refits fit each linear to its own output, on inputs that already carry the error of
the layers before it. Here every scale of the block (one per group of 128 weights) is trained together
on the block's output: the quantized block, given the quantized model's hidden states x_q (what the
calibration propagates), should give what the float model gives, F(x_f) on the float model's own hidden
states x_f (a second stream of calibration states, kept next to the first). So a block also repairs
some of the error it inherits, as OmniQuant's block-wise stage does; the codes and the checkpoint
format do not change. The loss is the error of each token's output relative to that token's target norm
(‖ŷ − y‖² / ‖y‖², averaged): the next block reads the stream through an RMSNorm, and a plain MSE would
be ruled by the few tokens with massive activations.

Parametrization as engine.quantization.scale_tuning's end-to-end tuning: scale = start · exp(θ), θ [N, K/G]
from 0, Adam with a cosine-decayed rate, minibatches of `batch_sequences` sequences, the forward and
backward passes in bfloat16 autocast (4-5x faster matmuls on CPUs with AVX512-BF16 / AMX; the final
outputs are computed in float32 from the fp16-rounded scales as stored). A slice of the sequences is held
out: the tuned scales are kept only when they lower the held-out loss, else the start scales stay.

Memory, besides the layer loop's: the block's weights assembled from codes × scales and their gradient
(2 × 4 B × the block's quantized parameters), the codes (1 B each), and one minibatch's activations with
their gradients; the float stream adds 2 × 4 B × calibration tokens × hidden.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from engine.errors import BonsaiError
from engine.quantization.calibration import Target, block_forward, rotary_tables
from quant.formats import fp16_scales


@dataclass(frozen=True)
class BlockTuningOptions:
    steps: int = 0  # Adam steps per block; 0: off
    lr: float = 5e-3  # Adam step of θ = log(scale / start scale), cosine-decayed to 0 (quantize.BLOCK_TUNE_LR)
    batch_sequences: int = 2  # calibration sequences per step
    held_out: float = 0.125  # fraction of the sequences kept aside to check that tuning helped
    bf16: bool = True  # forward / backward of the steps in bfloat16 autocast (CPU)
    seed: int = 0

    def __post_init__(self) -> None:
        if int(self.steps) < 0:
            raise BonsaiError(f"--block-tune-steps must be >= 0, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise BonsaiError(f"--block-tune-lr must be > 0, got {self.lr}")
        if int(self.batch_sequences) < 1:
            raise BonsaiError(f"block tuning batch_sequences must be >= 1, got {self.batch_sequences}")
        if not 0 < self.held_out < 1:
            raise BonsaiError(f"block tuning held_out must be between 0 and 1, got {self.held_out}")


@dataclass
class Quantized:
    """One tensor of the block as GPTQ left it: where it lives, its codes int8 [N, K] and scales [N, K/G]."""
    target: Target
    codes: torch.Tensor
    scales: torch.Tensor


class _BlockOutput(nn.Module):
    """block_forward as a module, so that torch.func.functional_call can swap its weights."""

    def __init__(self, block: nn.Module, model):
        super().__init__()
        self.block = block
        self.rope = lambda t, device: rotary_tables(model, t, device)  # not a submodule: model is on meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_forward(self.block, x, *self.rope(x.shape[1], x.device))  # [B, T, H]


def relative_error(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ‖y − target‖² / ‖target‖², y and target [B, T, H]."""
    d = (y.float() - target.float()).pow(2).sum(-1)  # [B, T]
    return (d / target.float().pow(2).sum(-1).clamp_min(1e-12)).mean()


def _sequences(chunks: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(c, r) for c, x in enumerate(chunks) for r in range(x.shape[0])]


def _stack(chunks: list[torch.Tensor], picks: list[tuple[int, int]]) -> torch.Tensor:
    return torch.stack([chunks[c][r] for c, r in picks])  # [B, T, H]


def _minibatches(chunks: list[torch.Tensor], picks: list[tuple[int, int]], size: int) -> list[list[tuple[int, int]]]:
    """Picks grouped by sequence length, `size` a batch."""
    by_len: dict[int, list[tuple[int, int]]] = {}
    for c, r in picks:
        by_len.setdefault(chunks[c].shape[1], []).append((c, r))
    return [group[i:i + size] for group in by_len.values() for i in range(0, len(group), size)]


class _Layout:
    """One weight of the block (a fused one too: q/k/v, gate/up) as codes [N, K] in the steps' dtype (rows not
    tuned: their float values, scale 1) times per-group scales at the finest group size G among its tensors,
    so that a step assembles it in one product: weight = codes · scales [N, K/G] expanded over the groups."""

    def __init__(self, param: torch.Tensor, members: list[tuple[int, Quantized]], dtype: torch.dtype):
        n, k = param.shape
        self.group = math.gcd(*(q.target.spec.group_size for _, q in members))
        self.codes = param.detach().to(dtype, copy=True)  # [N, K]
        self.pieces: list[tuple[int | None, int, int]] = []  # (tensor index or None: fixed rows, rows, repeat)
        pos = 0
        for i, q in sorted(members, key=lambda m: m[1].target.start):
            t = q.target
            if t.start > pos:
                self.pieces.append((None, t.start - pos, 1))
            self.codes[t.start:t.start + t.rows] = q.codes.to(param.device, dtype)
            self.pieces.append((i, t.rows, t.spec.group_size // self.group))
            pos = t.start + t.rows
        if pos < n:
            self.pieces.append((None, n - pos, 1))
        self.ones = torch.ones(n, k // self.group, device=param.device)  # [N, K/G]
        self.shape = (n, k)

    def weight(self, scales: list[torch.Tensor]) -> torch.Tensor:
        parts, row = [], 0
        for i, rows, repeat in self.pieces:
            s = self.ones[row:row + rows] if i is None else scales[i]  # [rows, K/G_i]
            parts.append(s.repeat_interleave(repeat, dim=1) if repeat > 1 else s)
            row += rows
        s = torch.cat(parts) if len(parts) > 1 else parts[0]  # [N, K/G]
        n, k = self.shape
        return (self.codes.view(n, -1, self.group) * s.to(self.codes.dtype)[..., None]).view(n, k)  # [N, K]


def tune_block(block: nn.Module, model, inputs: list[torch.Tensor], targets: list[torch.Tensor],
               outputs: list[torch.Tensor], tensors: list[Quantized], options: BlockTuningOptions,
               say: Callable[[str], None] | None = None) -> tuple[list[torch.Tensor], dict]:
    """Tune the scales of `tensors` (the block's quantized linears, the block holding their dequantized
    values) so that the block's outputs on `inputs` (chunks [B, T, H]) come near `targets` (same shapes).
    `outputs`: the block's outputs on `inputs` before tuning. Sets every tensor's `.scales` (fp16-rounded,
    float32) and the block's weights to the result; returns the block's outputs on `inputs` with them and
    a report (held-out loss before / after, kept)."""
    say = say or (lambda message: None)
    cpu_start = time.process_time()
    picks = _sequences(inputs)
    if len(picks) < 2 or not tensors or options.steps == 0:
        return outputs, {"steps": 0, "kept": False}
    gen = torch.Generator().manual_seed(options.seed)
    order = torch.randperm(len(picks), generator=gen).tolist()
    held = max(1, round(len(picks) * options.held_out))
    check, train = [picks[i] for i in order[:held]], [picks[i] for i in order[held:]]
    wrapped = _BlockOutput(block, model)
    names = {id(p): n for n, p in wrapped.named_parameters()}
    params = dict(wrapped.named_parameters())
    dtype = torch.bfloat16 if options.bf16 else torch.float32
    layouts = {}
    for pname in dict.fromkeys(names[id(t.target.param)] for t in tensors):
        layouts[pname] = _Layout(params[pname], [(i, t) for i, t in enumerate(tensors)
                                                 if names[id(t.target.param)] == pname], dtype)
    start = [t.scales.to(t.target.param.device, torch.float32) for t in tensors]  # [N, K/G] each, by the weights
    theta = [torch.zeros_like(s, requires_grad=True) for s in start]  # [N, K/G] each

    def weights(scales: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The block's weights (in the steps' dtype) holding codes × `scales` in the tuned rows."""
        return {pname: layout.weight(scales) for pname, layout in layouts.items()}

    def write(scales: list[torch.Tensor]) -> None:
        """The block's own float32 weights set to codes × `scales` (exact)."""
        for t, s in zip(tensors, scales):
            rows = t.target.param[t.target.start:t.target.start + t.target.rows]  # [N, K]
            g = t.target.spec.group_size
            rows.copy_((t.codes.to(rows.device).view(t.target.rows, -1, g).float() * s[..., None]).view_as(rows))

    def loss_on(outs: list[torch.Tensor]) -> float:
        return sum(relative_error(_stack(outs, [p]), _stack(targets, [p])).item() for p in check) / len(check)

    before = loss_on(outputs)
    batches = _minibatches(inputs, train, options.batch_sequences)
    optimizer = torch.optim.Adam(theta, lr=options.lr)
    for p in block.parameters():
        p.requires_grad_(False)
    last = float("nan")
    with torch.enable_grad():
        for step in range(options.steps):
            for group in optimizer.param_groups:
                group["lr"] = options.lr * 0.5 * (1 + math.cos(math.pi * step / options.steps))
            picked = batches[step % len(batches)]
            x, y = _stack(inputs, picked), _stack(targets, picked)  # [B, T, H] each
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=options.bf16):
                out = torch.func.functional_call(wrapped, weights([s * t.exp() for s, t in zip(start, theta)]), (x,))  # [B, T, H]
            loss = relative_error(out, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            last = loss.item()
    tuned = [fp16_scales(s * t.detach().exp()) for s, t in zip(start, theta)]  # [N, K/G], as stored
    with torch.no_grad():
        write(tuned)
        outs = [wrapped(x) for x in inputs]
    after = loss_on(outs)
    kept = after < before
    if kept:
        for t, s in zip(tensors, tuned):
            t.scales = s.to(t.scales.device)  # where quantize_block gave them (the CPU)
    else:  # the start scales back
        with torch.no_grad():
            write(start)
        outs = outputs
    say(f"block tuning: held-out error {before:.5f} → {after:.5f}" + ("" if kept else ": start scales kept"))
    return outs, {"steps": options.steps, "train_loss": last, "held_out_before": before, "held_out_after": after,
                  "kept": kept, "cpu_seconds": time.process_time() - cpu_start}
