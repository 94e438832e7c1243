"""Verification maths: which drafted tokens the target keeps, and its own next token (the bonus).

Pure functions of tensors, tested without a model. The target scored T = k + 1 rows in one pass:
row i is its distribution for the token after the last accepted token and drafts[:i].

- Greedy (temperature 0): accept while the draft equals the target's argmax; the bonus is the
  target's argmax at the first mismatch (or after the last draft). The output is exactly what
  plain greedy decoding produces.
- Sampling (temperature > 0): accept draft i with probability min(1, p_i(d) / q_i(d)); at the
  first rejection draw the bonus from normalize(max(p_i - q_i, 0)); after a fully accepted draft
  draw it from p_k. q is the drafter's distribution, or a one-hot at the drafted token when the
  drafter has none (n-gram). The output is distributed exactly as plain sampling from p.

p honours the request's temperature, top-k, top-p and min-p (`engine.decoding.sampling.probabilities`) and
its penalties, which depend on the tokens before each row: row i sees the counts updated by
drafts[:i] (`penalized_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.decoding.sampling import SamplingParams, apply_penalties, probabilities


@dataclass(frozen=True)
class Verdict:
    """accepted: how many drafted tokens were kept (a prefix); tokens: those plus the bonus."""
    accepted: int
    tokens: list[int]

    @property
    def bonus(self) -> int:
        return self.tokens[-1]


def penalized_rows(logits: torch.Tensor, drafts: list[int], seen_counts: torch.Tensor,
                   output_counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [T, V] → penalized logits [T, V]; row i's counts include drafts[:i]. The given
    counts ([V], prompt + output so far and output so far) are not modified."""
    if not params.uses_penalties:
        return logits
    assert logits.shape[0] <= len(drafts) + 1, (logits.shape, len(drafts))
    seen, output = seen_counts.clone(), output_counts.clone()
    rows = []
    for i in range(logits.shape[0]):
        rows.append(apply_penalties(logits[i], seen, output, params))  # [V]
        if i < len(drafts):
            seen[drafts[i]] += 1
            output[drafts[i]] += 1
    return torch.stack(rows)  # [T, V]


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> Verdict:
    """logits [k + 1, V] (penalized) → accept while drafts equal the argmax, then the bonus."""
    assert logits.shape[0] == len(drafts) + 1, (logits.shape, len(drafts))
    return accept_greedy(logits.argmax(dim=-1).tolist(), drafts)  # [k + 1], one read-back


def accept_greedy(target: list[int], drafts: list[int]) -> Verdict:
    """The target's argmax at each of the k + 1 rows → accept while drafts equal it, then the bonus
    (a caller verifying several sequences at once reads all argmaxes back together)."""
    assert len(target) == len(drafts) + 1, (len(target), len(drafts))
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return Verdict(n, drafts[:n] + [target[n]])


def verify_sampling(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                    params: SamplingParams, generator: torch.Generator | None) -> Verdict:
    """logits [k + 1, V] (penalized); draft_probs [k, V] or None (one-hot q) → lossless verdict."""
    k = len(drafts)
    assert logits.shape[0] == k + 1, (logits.shape, k)
    p = probabilities(logits, params)  # [k + 1, V]
    device = p.device
    n = 0
    if k:
        d = torch.tensor(drafts, device=device)  # [k]
        rows = torch.arange(k, device=device)
        p_d = p[rows, d]  # [k]
        q_d = draft_probs[rows, d].to(p.dtype) if draft_probs is not None else torch.ones_like(p_d)  # [k]
        u = torch.rand(k, generator=generator, device=device, dtype=p.dtype)  # [k]
        accept = (u * q_d < p_d).tolist()  # u < p/q without dividing by q
        while n < k and accept[n]:
            n += 1
    if n == k:
        bonus = int(torch.multinomial(p[k], 1, generator=generator))
        return Verdict(k, drafts + [bonus])
    q = (draft_probs[n].to(p.dtype) if draft_probs is not None
         else torch.nn.functional.one_hot(torch.tensor(drafts[n], device=device), p.shape[-1]).to(p.dtype))  # [V]
    residual = (p[n] - q).clamp_min(0)  # [V]
    if float(residual.sum()) <= 0:  # p == q up to rounding: the rejection had probability ~0
        residual = p[n]
    bonus = int(torch.multinomial(residual, 1, generator=generator))
    return Verdict(n, drafts[:n] + [bonus])


def verify_draft(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                 params: SamplingParams, generator: torch.Generator | None,
                 seen_counts: torch.Tensor | None = None, output_counts: torch.Tensor | None = None) -> Verdict:
    """Penalties (when the request has them: give both count vectors), then greedy or sampling."""
    if seen_counts is not None:
        logits = penalized_rows(logits, drafts, seen_counts, output_counts, params)
    if params.greedy:
        return verify_greedy(logits, drafts)
    return verify_sampling(logits, drafts, draft_probs, params, generator)
