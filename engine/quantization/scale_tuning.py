"""End-to-end scale tuning after GPTQ / GSQ: the codes stay fixed, every group scale of every quantized
tensor is trained together on the KL divergence of the whole model's next-token distribution from the
float model's, over the calibration sequences.

GPTQ and GSQ each fit one layer to its own output; their errors add up through the model, and no layer
sees what its error costs at the logits. Training only the scales on the model's output (as in
EfficientQAT's end-to-end stage) repairs part of that at a small cost: one float scale per group (1/64
or 1/128 of the weights) is trained, the codes are not touched, the checkpoint format does not change.

Parametrization: scale = start_scale · exp(θ), θ [N, K/G] starting at 0, trained with Adam (the step
is relative, the same for every tensor whatever its magnitude), cosine-decayed learning rate. A slice
of the calibration sequences (`held_out`) is never trained on: the mean KL on it is measured before
and after, and the start scales are returned when tuning did not lower it (never worse than where it
starts, on data it did not see).

Memory: the quantized model and the float model (the teacher) side by side on `device`, the codes of
every tuned tensor (int8), and one batch's activations and logits with their gradients.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.quantization.calibration import block_forward, block_targets, rotary_tables
from engine.errors import BonsaiError
from engine.runtime.model import Transformer


@dataclass(frozen=True)
class ScaleTuningOptions:
    steps: int = 0  # optimizer steps; 0: no tuning
    lr: float = 5e-4  # Adam step of θ = log(scale / start scale), cosine-decayed to 0 (SmolLM2: docs/quality-methods.md)
    batch_sequences: int = 4  # calibration sequences per step
    held_out: float = 0.125  # fraction of the sequences kept aside to check that tuning helped
    seed: int = 0

    def __post_init__(self) -> None:
        if int(self.steps) < 0:
            raise BonsaiError(f"scale tuning steps must be >= 0, got {self.steps}")
        if not self.lr > 0:
            raise BonsaiError(f"scale tuning learning rate must be > 0, got {self.lr}")
        if int(self.batch_sequences) < 1:
            raise BonsaiError(f"scale tuning batch_sequences must be >= 1, got {self.batch_sequences}")
        if not 0 < self.held_out < 1:
            raise BonsaiError(f"scale tuning held_out must be between 0 and 1, got {self.held_out}")


@dataclass(frozen=True)
class ScaleTuningReport:
    steps: int
    train_sequences: int
    held_out_sequences: int
    kl_before: float  # mean KL(float ‖ quantized) per token on the held-out sequences
    kl_after: float
    kept: bool  # False: tuning did not lower the held-out KL; the start scales were returned


class _SequenceLogits(nn.Module):
    """Logits [B, T, V] of whole sequences ids [B, T] (no KV cache), the calibration's block steps."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        model = self.model
        cos, sin = rotary_tables(model, ids.shape[1], ids.device)
        x = model.embed(ids).to(model.norm.weight.dtype)  # [B, T, H]
        for block in model.layers:
            x = block_forward(block, x, cos, sin)
        return model.output(model.norm(x)).float()  # [B, T, V]


def _segments(model: Transformer, quantized: dict[str, tuple]) -> dict[str, list[tuple[int, int, str | None]]]:
    """For every parameter holding a tuned tensor: its row ranges (start, rows, HF name or None = kept as
    it is), covering the whole parameter, keyed by the parameter's name in `_SequenceLogits`."""
    names = {id(p): f"model.{n}" for n, p in model.named_parameters()}
    spans: dict[str, list[tuple[int, int, str | None]]] = {}

    def add(param: torch.Tensor, start: int, rows: int, name: str) -> None:
        spans.setdefault(names[id(param)], []).append((start, rows, name))

    plan = (lambda name: quantized[name][2] if name in quantized else None)
    for i, block in enumerate(model.layers):
        for targets in block_targets(block, i, model.config, plan).values():
            for t in targets:
                add(t.param, t.start, t.rows, t.name)
    if "model.embed_tokens.weight" in quantized:
        add(model.embed.weight, 0, model.embed.weight.shape[0], "model.embed_tokens.weight")
    if "lm_head.weight" in quantized and model.lm_head is not None:
        add(model.lm_head.weight, 0, model.lm_head.weight.shape[0], "lm_head.weight")
    found = {name for parts in spans.values() for _, _, name in parts}
    if missing := set(quantized) - found:
        raise BonsaiError(f"scale tuning: no weight of the model holds {sorted(missing)[0]}")
    params = dict(model.named_parameters())
    out = {}
    for pname, parts in spans.items():
        total, filled, pos = params[pname[len("model."):]].shape[0], [], 0
        for start, rows, name in sorted(parts):
            if start > pos:
                filled.append((pos, start - pos, None))
            filled.append((start, rows, name))
            pos = start + rows
        if pos < total:
            filled.append((pos, total - pos, None))
        out[pname] = filled
    return out


def _mean_kl(student: Callable, teacher: nn.Module, batches: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in batches:
            total += _kl(student(ids), teacher(ids)).item() * ids.numel()
            count += ids.numel()
    return total / max(count, 1)


def _kl(logits: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(reference ‖ logits), both [B, T, V]."""
    log_q = F.log_softmax(logits.reshape(-1, logits.shape[-1]), dim=-1)  # [B·T, V]
    log_p = F.log_softmax(reference.reshape(-1, reference.shape[-1]), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


def tune_scales(student: Transformer, teacher: Transformer, sequences: list[list[int]],
                quantized: dict[str, tuple[torch.Tensor, torch.Tensor, Any]], options: ScaleTuningOptions,
                device: torch.device, say: Callable[[str], None] | None = None
                ) -> tuple[dict[str, torch.Tensor], ScaleTuningReport]:
    """quantized: HF name → (codes int8 [N, K], scales [N, K/G], spec with .group_size), the tensors the
    student holds dequantized. Returns the tuned scales by name (float32, CPU) and a report; the student's
    weights are left holding the returned scales' dequantized values. Sequences of one length each batch."""
    say = say or (lambda message: None)
    if len(sequences) < 2:
        raise BonsaiError("scale tuning needs at least 2 calibration sequences (one is held out)")
    held = max(1, round(len(sequences) * options.held_out))
    gen = torch.Generator().manual_seed(options.seed)
    order = torch.randperm(len(sequences), generator=gen).tolist()
    train_ids, check_ids = [sequences[i] for i in order[held:]], [sequences[i] for i in order[:held]]

    def batches(seqs: list[list[int]]) -> list[torch.Tensor]:
        by_len: dict[int, list[list[int]]] = {}
        for s in seqs:
            by_len.setdefault(len(s), []).append(s)
        return [torch.tensor(group[i:i + options.batch_sequences], device=device)  # [B, T]
                for group in by_len.values() for i in range(0, len(group), options.batch_sequences)]

    train, check = batches(train_ids), batches(check_ids)
    wrapped, reference = _SequenceLogits(student).to(device), _SequenceLogits(teacher).to(device)
    segments = _segments(student, quantized)
    params = dict(wrapped.named_parameters())
    codes = {n: c.to(device) for n, (c, _, _) in quantized.items()}  # int8 [N, K]
    start = {n: s.to(device, torch.float32) for n, (_, s, _) in quantized.items()}  # [N, K/G]
    group = {n: spec.group_size for n, (_, _, spec) in quantized.items()}
    theta = {n: torch.zeros_like(s, requires_grad=True) for n, s in start.items()}  # [N, K/G]

    def weights(thetas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for pname, parts in segments.items():
            base, pieces = params[pname], []
            for first, rows, name in parts:
                if name is None:
                    pieces.append(base[first:first + rows].detach())
                    continue
                scale = (start[name] * thetas[name].exp()).repeat_interleave(group[name], dim=1)  # [N, K]
                pieces.append((codes[name].float() * scale).to(base.dtype))
            out[pname] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return out

    def student_logits(ids: torch.Tensor, thetas: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(wrapped, weights(thetas), (ids,))

    for p in wrapped.parameters():
        p.requires_grad_(False)
    zeros = {n: torch.zeros_like(t) for n, t in theta.items()}
    kl_before = _mean_kl(lambda ids: student_logits(ids, zeros), reference, check)
    say(f"scale tuning: {sum(t.numel() for t in theta.values())} scales of {len(theta)} tensors, "
        f"{len(train_ids)} sequences ({len(check_ids)} held out, KL {kl_before:.4f}), {options.steps} steps")
    optimizer = torch.optim.Adam(list(theta.values()), lr=options.lr)
    for step in range(options.steps):
        for g in optimizer.param_groups:
            g["lr"] = options.lr * 0.5 * (1 + math.cos(math.pi * step / options.steps))
        ids = train[step % len(train)]
        with torch.no_grad():
            target = reference(ids)  # [B, T, V]
        loss = _kl(student_logits(ids, theta), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if (step + 1) % max(1, options.steps // 10) == 0 or step + 1 == options.steps:
            say(f"scale tuning: step {step + 1}/{options.steps}, train KL {loss.item():.4f}")
    tuned = {n: t.detach().clone() for n, t in theta.items()}
    kl_after = _mean_kl(lambda ids: student_logits(ids, tuned), reference, check)
    kept = kl_after < kl_before
    final = tuned if kept else zeros
    say(f"scale tuning: held-out KL {kl_before:.4f} → {kl_after:.4f}" + ("" if kept else ": start scales kept"))
    with torch.no_grad():
        for pname, w in weights(final).items():
            params[pname].copy_(w)
    scales = {n: (start[n] * final[n].exp()).cpu() for n in theta}
    return scales, ScaleTuningReport(options.steps, len(train_ids), len(check_ids), kl_before, kl_after, kept)
