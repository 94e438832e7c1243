"""Bookkeeping shared by drafters that read the target's hidden states (MTP, DFlash): which verified
rows have arrived since the last proposal, at which positions, with which next tokens; and how a
drafted token is picked (argmax, or sampled under the request's parameters with its probabilities).

Row convention: the target's hidden state at position p is the output of feeding token p; the token
it predicted is p + 1. Feedback brings the kept rows of a verification, which end right before the
bonus token; so at the next `propose(context, k)` the newest row sits at position len(context) - 2
and every row's next token is known from the context. Nothing here depends on which drafter
proposed the verified tokens (a mix may have chosen another member's draft).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.decoding.sampling import SamplingParams, make_generator, probabilities
from engine.speculative.drafter import Feedback


PROMPT_ROWS = 512  # the prompt's newest positions a native MTP head's cache gets (their hidden states kept by prefill)


@dataclass
class NewRows:
    positions: list[int]  # absolute positions of the rows, ascending and consecutive
    hidden: dict[int, torch.Tensor]  # layer → [n, hidden]
    next_tokens: list[int]  # the token each row predicts (context[p + 1])


class HiddenStateRows:
    """Rows of target hidden states received but not yet consumed by the drafter."""

    def __init__(self, layers: tuple[int, ...]):
        self.layers = layers
        self._chunks: list[dict[int, torch.Tensor]] = []

    def clear(self) -> None:
        self._chunks.clear()

    def add_rows(self, hidden: dict[int, torch.Tensor]) -> None:
        """Rows that are no verification's: the prompt's newest positions ({layer: [n, H]}), after `clear`."""
        self._chunks.append({i: hidden[i] for i in self.layers})

    def add(self, feedback: Feedback) -> None:
        if feedback.hidden is None:
            self.clear()  # the loop ran without hidden states: the drafter restarts from the next rows
            return
        missing = [i for i in self.layers if i not in feedback.hidden]
        assert not missing, f"feedback lacks hidden states of layers {missing}"
        n = feedback.accepted + 1
        self._chunks.append({i: feedback.hidden[i][-n:] for i in self.layers})

    def take(self, context: list[int]) -> NewRows | None:
        """The pending rows placed against `context` (newest at len(context) - 2), or None if none."""
        if not self._chunks:
            return None
        hidden = {i: torch.cat([c[i] for c in self._chunks], dim=0) for i in self.layers}  # [n, H]
        self._chunks.clear()
        n = next(iter(hidden.values())).shape[0]
        last = len(context) - 2
        if last - n + 1 < 0:  # more rows than positions: keep the newest that fit
            hidden = {i: h[h.shape[0] - (last + 1):] for i, h in hidden.items()}
            n = last + 1
        if n <= 0:
            return None
        positions = list(range(last - n + 1, last + 1))
        return NewRows(positions, hidden, [context[p + 1] for p in positions])


class TokenPicker:
    """Greedy drafting (no probabilities: verification counts q = 1 for the token, which keeps any
    temperature lossless), or sampling from the request's distribution with its probabilities."""

    def __init__(self, sampling: SamplingParams | None = None, device: torch.device | str = "cpu",
                 vocab: int | None = None):
        self.device = torch.device(device)
        self.vocab = vocab  # only ids below it are drafted (the engine cuts a draft at the first id above)
        self.set_sampling(sampling)

    def set_sampling(self, sampling: SamplingParams | None) -> None:
        """A seeded request drafts reproducibly, from a stream apart from the verifier's."""
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        self.generator = None
        if self.sampling is not None:
            self.generator = make_generator(self.sampling, self.device)
            if self.sampling.seed is not None:
                self.generator.manual_seed((self.sampling.seed * 1_000_003 + 11) % 2**63)

    def pick(self, logits: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """logits [n, V] → n tokens and their distributions [n, V'] (None when greedy; V' = vocab if set)."""
        logits = logits[:, :self.vocab]  # [n, V']
        if self.sampling is None:
            return logits.argmax(-1).tolist(), None
        probs = probabilities(logits, self.sampling)  # [n, V]
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0].tolist(), probs


class HiddenStateDrafterBase:
    """What the MTP and DFlash drafters share: the drafter module's own KV cache ([L, 1, KV, S, D],
    `length` committed rows), the target hidden-state rows still to commit, and the token picker."""

    def __init__(self, module, target_loaded, hidden_layers: tuple[int, ...], max_seq_len: int | None,
                 sampling, name: str):
        self.name = name
        self.module = module
        self.target = target_loaded.model
        self.hidden_layers = hidden_layers
        cfg, tcfg = module.cfg, target_loaded.config
        self.capacity = int(max_seq_len or min(tcfg.max_position_embeddings, 4096))
        device = target_loaded.device
        shape = (cfg.num_layers, 1, cfg.num_kv_heads, self.capacity, cfg.head_dim)
        dtype = next(module.parameters()).dtype
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, KV, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, KV, S, D]
        self.length = 0  # committed rows
        self.rows = HiddenStateRows(hidden_layers)
        # the prompt's newest positions whose hidden states it takes in (engine.decoding.spec_step asks the runner
        # to keep them while it prefills): 0 for drafters bonsai trains (trained from the prompt's end on,
        # engine.speculative.mtp.train_masks); a checkpoint's own MTP head takes PROMPT_ROWS (native_mtp)
        self.prompt_rows = 0
        # the ids the target's tokenizer can print, as the engine counts them (a padded or borrowed vocabulary)
        tok = target_loaded.tokenizer
        self.picker = TokenPicker(sampling, device, min(tcfg.vocab_size, tok.vocab_size) if tok is not None else None)

    def begin(self, prompt: list[int]) -> None:
        self.length = 0
        self.rows.clear()
        self._forget_last()

    def _forget_last(self) -> None:
        """Drop what the subclass remembers of the newest committed row."""

    def observe(self, feedback) -> None:
        self.rows.add(feedback)

    def observe_prompt(self, hidden: dict[int, torch.Tensor]) -> None:
        """The target's hidden states [n, H] of the prompt's newest n positions (asked for by `prompt_rows`),
        before the first proposal: the drafter's own cache then holds the prompt's end too."""
        self.rows.add_rows(hidden)

    def set_sampling(self, params) -> None:
        """The request's SamplingParams: sampled drafts with their probabilities when not greedy."""
        self.picker.set_sampling(params)

    def _past(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = self.length
        return [(self.k[i, :, :, :n], self.v[i, :, :, :n]) for i in range(self.k.shape[0])]
