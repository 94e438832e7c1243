"""One constrained sequence's grammar state, and the token mask applied to logits rows.

`GrammarMatch` wraps an xgrammar matcher: `allowed(mask_row)` fills one row of a bitmask (int32,
32 tokens a word, bit set = allowed) for the next token, `accept(token)` advances (False: the
grammar refuses it, nothing changes), `rollback(n)` undoes the last n accepted tokens (speculation),
`is_terminated()` says the grammar is complete (the sequence then ends, finish_reason "stop").
`mask_rows(logits, matches, rows)` applies the masks of the constrained rows of a batch to a copy of
its logits: the other rows are left as they are and cost nothing.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from engine.decoding.grammar import GrammarSpec, compile_spec


class GrammarMatch:
    def __init__(self, spec: GrammarSpec, tokenizer: Any, vocab: int, max_rollback: int = -1):
        """vocab: the width of the logits rows this sequence chooses from."""
        import xgrammar  # here, not at module import: it imports transformers (~1.7 s a start)
        self.spec, self.vocab = spec, vocab
        eos = sorted(i for i in getattr(tokenizer, "eos_ids", ()) if i < vocab)
        self.matcher = xgrammar.GrammarMatcher(compile_spec(spec, tokenizer, vocab),
                                               terminate_without_stop_token=not eos,
                                               max_rollback_tokens=max_rollback)

    def allowed(self, mask: torch.Tensor, row: int = 0) -> None:
        """Fill row `row` of mask [n, words] (int32, CPU) with the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(mask, row)

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(int(token))

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with the refused tokens at -inf (a copy)."""
        return mask_rows(logits[None], [self], [0])[0]

    def draft_masks(self, tokens: list[int]) -> torch.Tensor:
        """The masks [n + 1, words] of the positions after each prefix of `tokens` (all of which the grammar
        takes: accept_prefix cut them), the state left unchanged."""
        mask = bitmask(len(tokens) + 1, self.vocab)
        for j, t in enumerate(tokens):
            self.allowed(mask, j)
            assert self.accept(t), "a draft the grammar refuses was not cut"
        self.allowed(mask, len(tokens))
        self.rollback(len(tokens))
        return mask

    def accept_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar takes in a row from here (the state is left unchanged)."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n


@functools.cache
def _batch_filler() -> Any:
    """xgrammar's batch matcher (a thread pool of half the host's cores), made on first use."""
    import xgrammar  # here, not at module import: it imports transformers (~1.7 s a start)
    return xgrammar.BatchGrammarMatcher()


def bitmask(rows: int, vocab: int) -> torch.Tensor:
    """A bitmask [rows, words] allowing every token (int32, CPU)."""
    import xgrammar  # here, not at module import: it imports transformers (~1.7 s a start)
    return xgrammar.allocate_token_bitmask(rows, vocab)


def apply_mask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [n, V] (any device) with the tokens whose bit is clear in mask [n, words] at -inf, in
    place where xgrammar's kernel runs (CPU, CUDA), else through torch; returns the logits."""
    import xgrammar  # here, not at module import: it imports transformers (~1.7 s a start)
    try:
        xgrammar.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True),
                                             vocab_size=logits.shape[-1])
        return logits
    except (RuntimeError, ValueError, TypeError):  # a device or dtype the kernels lack: the same in torch
        return apply_mask_torch(logits, mask)


def apply_mask_torch(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The torch form of apply_mask (in place; returns logits)."""
    n, v = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)  # [32]
    bits = (mask.to(logits.device)[:, :, None] >> shifts) & 1  # [n, words, 32]
    allowed = bits.reshape(n, -1)[:, :v].bool()  # [n, V]
    return logits.masked_fill_(~allowed, float("-inf"))


def mask_rows(logits: torch.Tensor, matches: list[GrammarMatch], rows: list[int]) -> torch.Tensor:
    """logits [B, V] with row rows[j] masked by matches[j]'s grammar: a copy of the constrained rows
    written into a copy of the batch (the runner's logits are never changed)."""
    mask = bitmask(len(rows), logits.shape[-1])  # [n, words]
    if len(matches) > 1:  # the rows filled side by side on xgrammar's threads (the same bits as one by one)
        _batch_filler().batch_fill_next_token_bitmask([m.matcher for m in matches], mask)
    else:
        matches[0].allowed(mask, 0)
    out = logits.clone()  # [B, V]
    index = torch.tensor(rows, device=logits.device)
    out[index] = apply_mask(out[index].float() if out.dtype != torch.float32 else out[index], mask).to(out.dtype)
    return out
