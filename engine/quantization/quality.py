"""The quality report of `bonsai quantize`: the written checkpoint against its float source, layer by layer.

The held-out windows run through the float model while it is quantized (engine.quantization.layerwise keeps their
final-norm states); afterwards they run through the checkpoint as written, one layer at a time, and
both output layers are applied in slices of the vocabulary. `VocabScores` accumulates, per position,
the log-sum-exp of both logit rows, KL(reference ‖ model), the target's log-probabilities and both
argmaxes online (as flash attention does its softmax), so the [positions, vocabulary] logits never
exist whole: the report costs one layer and one slice of the output layer of memory, as the
quantization does. The numbers are `bonsai eval`'s (engine.quantization.evaluate: the same windows and scores).
"""
from __future__ import annotations

import math
from typing import Callable
from pathlib import Path

import torch

from engine.quantization.evaluate import EvalResult
from engine.sources.model_config import ModelConfig
from engine.quantization.float_source import EMBED, HEAD, FloatSource

SCORE_BYTES = 16 << 20  # float64 bytes of one [positions, vocabulary slice] block of logits


class VocabScores:
    """Scores of a model's next-token distributions against a reference's, fed slice by slice of the
    vocabulary: `add(reference_logits [T, C], logits [T, C], first id of the slice)`."""

    def __init__(self, targets: torch.Tensor):
        t = targets.shape[0]
        self.targets = targets  # [T] the tokens that followed
        full = lambda v: torch.full((t,), v, dtype=torch.float64)  # noqa: E731
        self.max_ref, self.sum_ref, self.cross = full(-math.inf), full(0.0), full(0.0)
        self.max_q, self.sum_q = full(-math.inf), full(0.0)
        self.target_ref, self.target_q = full(0.0), full(0.0)
        self.best_ref, self.best_q = full(-math.inf), full(-math.inf)
        self.top_ref = torch.zeros(t, dtype=torch.long)
        self.top_q = torch.zeros(t, dtype=torch.long)

    def add(self, ref: torch.Tensor, logits: torch.Tensor, offset: int) -> None:
        ref, logits = ref.double().cpu(), logits.double().cpu()  # [T, C]
        c = ref.shape[1]
        new_max = torch.maximum(self.max_ref, ref.max(1).values)  # [T]
        rescale = torch.exp(self.max_ref - new_max)
        weights = torch.exp(ref - new_max[:, None])  # [T, C] = p · Σ so far
        self.sum_ref = self.sum_ref * rescale + weights.sum(1)
        self.cross = self.cross * rescale + (weights * (ref - logits)).sum(1)  # Σ p (z_ref - z)
        self.max_ref = new_max
        new_max = torch.maximum(self.max_q, logits.max(1).values)
        self.sum_q = self.sum_q * torch.exp(self.max_q - new_max) + torch.exp(logits - new_max[:, None]).sum(1)
        self.max_q = new_max
        inside = (self.targets >= offset) & (self.targets < offset + c)  # [T]
        local = (self.targets - offset).clamp(0, c - 1)[:, None]
        self.target_ref = torch.where(inside, ref.gather(1, local)[:, 0], self.target_ref)
        self.target_q = torch.where(inside, logits.gather(1, local)[:, 0], self.target_q)
        for z, best, top in ((ref, self.best_ref, self.top_ref), (logits, self.best_q, self.top_q)):
            value, index = z.max(1)
            better = value > best
            best.copy_(torch.where(better, value, best))
            top.copy_(torch.where(better, index + offset, top))

    def result(self) -> EvalResult:
        lse_ref = self.max_ref + self.sum_ref.log()  # [T]
        lse_q = self.max_q + self.sum_q.log()
        kl = (self.cross / self.sum_ref - lse_ref + lse_q).clamp_min(0)  # Σ p (log p - log q)
        nll, ref_nll = lse_q - self.target_q, lse_ref - self.target_ref
        return EvalResult(tokens=int(kl.numel()), perplexity=math.exp(float(nll.mean())),
                          reference_perplexity=math.exp(float(ref_nll.mean())), kl_mean=float(kl.mean()),
                          kl_p99=float(torch.quantile(kl, 0.99)), kl_max=float(kl.max()),
                          same_top=float((self.top_ref == self.top_q).double().mean()))


def score_outputs(ref_states: torch.Tensor, states: torch.Tensor, targets: torch.Tensor, vocab: int,
                  ref_rows, rows, slice_rows: int) -> EvalResult:
    """ref_states, states [T, H] (final-norm outputs of the reference and of the model at the scored
    positions), targets [T]; ref_rows(start, stop) / rows(start, stop): those rows of each output layer
    (float32 [n, H]). The logits are computed slice_rows of the vocabulary at a time."""
    scores = VocabScores(targets.cpu())
    for start in range(0, vocab, slice_rows):
        stop = min(start + slice_rows, vocab)
        w_ref = ref_rows(start, stop).to(ref_states.device)  # [C, H]
        w = rows(start, stop).to(states.device)
        scores.add(ref_states @ w_ref.T, states @ w.T, start)  # [T, C] each
    return scores.result()


def evaluate_written(checkpoint_dir: Path, config: ModelConfig, windows: list[list[int]], ref_states: torch.Tensor,
                     reference: FloatSource, device: str, down_block: int,
                     progress: Callable[[str, int, int], None] = lambda message, done, total: None) -> EvalResult:
    """Run the windows through the checkpoint in `checkpoint_dir` (or a GGUF exported from it: as written,
    one layer at a time) and
    score its next-token distributions against the reference's final-norm states ref_states [positions, H]
    (engine.quantization.layerwise.quantize_layers' return) with the reference's output layer."""
    from engine.quantization.layerwise import (EVAL_BATCH, Batches, batches_of, embed_batches, free_block, load_block, run_block,
                                  skeleton)
    from engine.weights.loader import open_model_source
    dev = torch.device(device)
    source = FloatSource(open_model_source(checkpoint_dir), config)
    model = skeleton(config, source, dev)
    ids = batches_of(windows, EVAL_BATCH)
    states = Batches(ids, embed_batches(source, ids, None, dev))
    with torch.no_grad():
        for i in range(config.num_layers):
            progress(f"scoring: layer {i + 1}/{config.num_layers}", i, config.num_layers)
            block = load_block(model, i, source, dev, down_block)
            run_block(model, block, states)
            free_block(model, i)
        final = torch.cat([model.norm(x)[:, :-1].reshape(-1, config.hidden_size) for x in states.hidden])
        targets = torch.cat([b[:, 1:].reshape(-1) for b in ids])
        head, ref_head = (EMBED if source.tied else HEAD), (EMBED if reference.tied else HEAD)
        slice_rows = max(256, SCORE_BYTES // (8 * max(targets.numel(), 1)))
        return score_outputs(ref_states, final, targets, config.vocab_size,
                             lambda a, b: reference.read_rows(ref_head, a, b),
                             lambda a, b: source.read_rows(head, a, b), slice_rows)
