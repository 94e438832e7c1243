"""Sampling maths: pure functions of logits, tested without any model."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.errors import BonsaiError


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy (argmax).

    repetition_penalty (HF style, >1 discourages) applies to every token seen (prompt + output);
    presence_penalty and frequency_penalty (OpenAI style, in logits) apply to the output so far.
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id → added to its logit, in [-100, 100]

    def __post_init__(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict) or not all(isinstance(t, int) and t >= 0 for t in bias):
            raise BonsaiError("invalid sampling parameter: logit_bias keys must be token ids (integers >= 0)")
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in bias.values()):
            raise BonsaiError("invalid sampling parameter: logit_bias values must be finite numbers")
        # clamped to [-100, 100] as OpenAI does (-100 bans a token, +100 all but forces it)
        object.__setattr__(self, "logit_bias", {t: max(-100.0, min(100.0, float(v))) for t, v in bias.items()})
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 disables it)"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.seed is None or -(2**63) <= self.seed < 2**64, "seed must be in [-2^63, 2^64)"),
        ]
        for ok, message in checks:
            if not ok:
                raise BonsaiError(f"invalid sampling parameter: {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def bias_tensors(bias: dict[int, float], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n] int64, values [n] float32) of a logit_bias, made once per request."""
    return (torch.tensor(list(bias), dtype=torch.long, device=device),
            torch.tensor(list(bias.values()), dtype=torch.float32, device=device))


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """logits [..., V] plus values[j] at id ids[j] of every row, bias = (ids, values) of bias_tensors (a copy)."""
    ids, values = bias
    return logits.index_add(-1, ids, values.to(logits.dtype).expand(*logits.shape[:-1], -1))


def apply_penalties(logits: torch.Tensor, seen_counts: torch.Tensor, output_counts: torch.Tensor,
                    params: SamplingParams) -> torch.Tensor:
    """logits [V]; seen_counts (prompt + output) and output_counts [V] → penalized logits [V]."""
    out = logits
    if params.repetition_penalty != 1:
        seen = seen_counts > 0
        penalized = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
        out = torch.where(seen, penalized, out)
    if params.presence_penalty or params.frequency_penalty:
        out = out - params.presence_penalty * (output_counts > 0) - params.frequency_penalty * output_counts
    return out


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampled from: temperature, then top-k, top-p and min-p filters. [.., V]."""
    assert not params.greedy
    logits = logits.float()
    # shifted by the top logit and divided by a temperature float32 can hold: finite for any
    # temperature > 0 (1e-300 included: the top token then has all the mass, as it should)
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p * sorted_probs.sum(-1, keepdim=True), 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs / probs.sum(-1, keepdim=True)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from logits [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = probabilities(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """One token id per row of logits [B, V], row i with params[i] and generators[i]: the ids
    `sample` gives row by row, read back in one transfer (one device sync for the whole batch, not
    one per row). Greedy rows take one argmax together; rows with the same filters get their
    distribution computed together; each sampled row is then drawn with its own generator."""
    return sample_rows_on_device(logits, params, generators).tolist()


def sample_rows_on_device(logits: torch.Tensor, params: list[SamplingParams],
                          generators: list[torch.Generator | None]) -> torch.Tensor:
    """`sample_rows`'s ids as a tensor [B] (int64) on the logits' device, not read back: the next decode step can
    take them as its input before the host knows them (engine.decoding.lookahead)."""
    assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators)
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)  # [B]
    groups: dict[tuple, list[int]] = {}
    for row, p in enumerate(params):
        key = ("greedy",) if p.greedy else (p.temperature, p.top_k, p.top_p, p.min_p)
        groups.setdefault(key, []).append(row)
    order: list[int] = []
    picks: list[torch.Tensor] = []
    for key, rows in groups.items():
        index = rows if len(rows) < len(params) else slice(None)
        if key == ("greedy",):
            picks.append(logits[index].argmax(dim=-1))  # [n]
        else:
            probs = probabilities(logits[index], params[rows[0]])  # [n, V]
            picks += [torch.multinomial(probs[j], 1, generator=generators[row]) for j, row in enumerate(rows)]
        order += rows
    picked = torch.cat(picks)  # [B] in group order
    if order == list(range(len(params))):
        return picked
    out = torch.empty_like(picked)  # [B] in row order
    out[torch.tensor(order, device=picked.device)] = picked
    return out


def greedy_on_device(logits: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
    """The argmax [n] of each row of logits [n, V] among its first `vocab` ids, left on the device (no read-back:
    a CUDA graph can chain it, as engine.speculative.mtp_graph does)."""
    return logits[:, :vocab].argmax(dim=-1)


def greedy_tokens(*logits: torch.Tensor) -> list[int]:
    """The argmax of every row of each logits [n, V], read back in one transfer (one device sync)."""
    return torch.cat([x.argmax(dim=-1) for x in logits]).tolist()


def top_logprobs(logits: torch.Tensor, token: int, n: int, decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """The OpenAI logprobs entry of `token` chosen from logits [V]: its log-probability and the n most
    likely tokens' (decode: token ids → text)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [V] (after a grammar's mask: renormalized over allowed ids)
    top = torch.topk(logp, min(n, int(torch.isfinite(logp).sum()))) if n else None  # never a refused id

    def entry(t: int, lp: float) -> dict[str, Any]:
        s = decode([t])
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    item = entry(token, float(logp[token]))
    item["top_logprobs"] = ([entry(int(t), float(v)) for v, t in zip(top.values.tolist(), top.indices.tolist())]
                            if top is not None else [])
    return item
