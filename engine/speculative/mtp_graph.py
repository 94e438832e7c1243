"""An MTP drafter's two steps over static buffers, CUDA-graphed on a GPU (engine.runtime.cuda_graphs.KeyedGraphs):
the commit of n verified rows (their K/V written into the drafter's cache, the last row's output kept) and the
greedy chain of k drafts (each argmax taken on the device and fed back as the next step's token), so a proposal
is two replays and one read-back of k token ids instead of ~30 eager launches a token (docs/perf.md, session 18:
an eager chained token cost 1.5 ms on the 27B shape, 1.1 target steps on the 0.8B).

Shapes are fixed per key: a graph per row count n and per draft length k, captured on first use. Attention reads
the drafter's whole cache [L, 1, KV, S, D] under a mask of each row's visible keys (computed on the device from
the committed length). The same code runs eagerly off the GPU (tests check it against MTPDrafter's own path).
Greedy drafting only (sampled drafts carry their distributions: MTPDrafter's path).
"""
from __future__ import annotations

import torch

from engine.decoding.sampling import greedy_on_device
from engine.runtime.cuda_graphs import KeyedGraphs
from engine.speculative.draft_layers import rotary

MAX_ROWS = 65  # rows one commit takes (a verify of up to 64 drafts + 1) and drafts one chain makes


class StaticChain:
    """The static buffers and steps of one MTPDrafter (its module, target and KV cache)."""

    def __init__(self, drafter, vocab: int | None, graphed: bool):
        self.d = drafter
        device, dtype = drafter.k.device, drafter.k.dtype
        h = drafter.target.config.hidden_size
        self.vocab = vocab
        self.hidden = torch.zeros(MAX_ROWS, h, dtype=dtype, device=device)  # [n, H] the rows' target hidden states
        self.tokens = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)  # [n] each row's next token
        self.positions = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)  # [n]
        self.rows = torch.arange(MAX_ROWS, device=device)  # [MAX_ROWS]
        self.keys = torch.arange(drafter.capacity, device=device)  # [S]
        self.length = torch.zeros(1, dtype=torch.long, device=device)  # committed rows before the commit
        self.valid = torch.zeros(1, dtype=torch.long, device=device)  # committed rows after it
        self.last_position = torch.zeros(1, dtype=torch.long, device=device)
        self.out = torch.zeros(h, dtype=dtype, device=device)  # [H] the last committed row's output
        self.drafts = torch.zeros(MAX_ROWS, dtype=torch.long, device=device)  # [k]
        self.graphs = KeyedGraphs(graphed)

    def commit(self, hidden: torch.Tensor, next_tokens: list[int], positions: list[int], length: int) -> torch.Tensor:
        """Rows hidden [n, H] (the target's last-block output) with their next tokens and positions after `length`
        committed rows: K/V written at length.., returns the last row's output [H] (a static buffer)."""
        n = len(positions)
        self.hidden[:n].copy_(hidden)
        self.tokens[:n].copy_(torch.tensor(next_tokens), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions), non_blocking=True)
        self.length.fill_(length)
        self.graphs.run(("commit", n), lambda: self._commit(n))
        return self.out

    def chain(self, k: int) -> list[int]:
        """k greedy drafts after the last commit (its output and position)."""
        self.graphs.run(("chain", k), lambda: self._chain(k))
        return self.drafts[:k].tolist()

    def _commit(self, n: int) -> None:
        module, target = self.d.module, self.d.target
        hidden = module.target_hidden(target, self.hidden[:n]).to(self.out.dtype)  # [n, H]
        embedded = target.embed(self.tokens[:n]).to(self.out.dtype)  # [n, H]
        write = self.length + self.rows[:n]  # [n] cache rows, each row sees the keys up to its own
        y = self._run(module.inputs(hidden[None], embedded[None]), self.positions[:n][None], write)  # [1, n, H]
        self.out.copy_(y[0, -1])
        self.last_position.copy_(self.positions[n - 1:n])
        self.valid.copy_(self.length + n)

    def _chain(self, k: int) -> None:
        module, target = self.d.module, self.d.target
        out = self.out
        for c in range(k):
            logits = module.logits(target, out[None])  # [1, V]
            token = greedy_on_device(logits, self.vocab)  # [1] on the device
            self.drafts[c:c + 1].copy_(token)
            if c == k - 1:
                break
            embedded = target.embed(token).to(out.dtype)  # [1, H]
            x = module.inputs(out[None], embedded)[None]  # [1, 1, H]
            y = self._run(x, (self.last_position + 1 + c)[None], self.valid + c)  # [1, 1, H]
            out = y[0, -1]

    def _run(self, x: torch.Tensor, positions: torch.Tensor, write: torch.Tensor) -> torch.Tensor:
        """x [1, T, H] at positions [1, T], written at cache rows `write` [T], each row attending to the cache's
        rows up to its own → the module's output [1, T, H]."""
        module = self.d.module
        cos, sin = rotary(positions, module.inv_freq)
        mask = (self.keys[None, :] <= write[:, None])[None, None]  # [1, 1, T, S]
        for i, block in enumerate(module.blocks):
            x = block.forward_cached(x, cos, sin, self.d.k[i], self.d.v[i], write, mask)
        return module.finish(x)
