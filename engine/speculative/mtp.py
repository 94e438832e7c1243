"""Multi-token-prediction drafter: the target's last hidden state at position p and the embedding
of token p + 1 go through a small block (two norms, a projection of their concatenation, one
transformer block) and the target's own final norm + LM head, predicting token p + 2. Depth > 1
chains it: its own output hidden state and its drafted token are the next step's inputs.

Factory (what `--spec mtp:PATH` calls):
    load_mtp_drafter(path, target_loaded, *, max_seq_len=None, sampling=None) -> MTPDrafter
      path: a drafter file (or the directory holding drafter.safetensors) written by
      `bonsai train-drafter --kind mtp`; refused in one line if trained for another model.
      max_seq_len: rows of its own KV cache (default: the target's context, at most 4096).
      sampling: the request's SamplingParams (also settable per request: `set_sampling(params)`,
      which the generation core calls); when not greedy, drafts are sampled from it and
      Draft.probs holds their distributions; otherwise drafts are argmax and probs is None
      (verification then counts q = 1, lossless at any temperature).
The drafter keeps a KV cache for its block: one row per verified target position (its inputs are
real target hidden states); the chained rows of a proposal are never stored, so a rejection needs
no rewind beyond dropping them. Rows exist from the first verification on (the prompt's hidden
states are not delivered by the runner's prefill; the target's hidden state carries the prompt).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.runtime.model import Linear, RMSNorm, Transformer
from engine.speculative.draft_layers import (DraftBlock, DrafterConfig, drafter_inverse_frequencies,
                                             init_drafter_weights, rotary, shared_logits, to_target)
from engine.speculative.drafter import Draft
from engine.speculative.drafter_file import TargetIdentity, read_drafter
from engine.speculative.hidden_drafter import HiddenStateDrafterBase
from engine.speculative.mtp_graph import MAX_ROWS, StaticChain


class MTPModule(nn.Module):
    def __init__(self, cfg: DrafterConfig, vocab_size: int):
        super().__init__()
        assert cfg.kind == "mtp"
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.proj = Linear(2 * h, h)
        block_cfg = cfg.block_config(vocab_size)
        self.blocks = nn.ModuleList(DraftBlock(block_cfg) for _ in range(cfg.num_layers))
        self.register_buffer("inv_freq", drafter_inverse_frequencies(cfg, vocab_size), persistent=False)

    def inputs(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[.., H] hidden state and [.., H] embedding of the next token → block input [.., H]."""
        return self.proj(torch.cat([self.embed_norm(embedded), self.hidden_norm(hidden)], dim=-1))

    def target_hidden(self, target: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        """The target's last-block output [.., H] as this module reads it (as it is)."""
        return hidden

    def logits(self, target: Transformer, out: torch.Tensor) -> torch.Tensor:
        """Logits [.., V] (float32) of outputs [.., H]: the target's final norm and LM head."""
        return shared_logits(target, out)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks' output as `run` returns it (as it is)."""
        return x

    def run(self, x: torch.Tensor, positions: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None,
            mask: torch.Tensor | None) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """x [B, T, H] at positions [B, T] after `past` (per block: k, v [B, KV, S, D]) →
        (out [B, T, H], per block the new rows' k, v)."""
        cos, sin = rotary(positions, self.inv_freq)
        new = []
        for i, block in enumerate(self.blocks):
            pk, pv = past[i] if past is not None else (None, None)
            x, k, v = block(x, cos, sin, pk, pv, mask)
            new.append((k, v))
        return x, new


def train_masks(starts: torch.Tensor, length: int, depth: int) -> torch.Tensor:
    """Attention mask [B, 1, T, depth·T] of the depth-`depth` rows in training: row j sees the
    depth-1 rows start..j (verified positions; nothing before the drafter's start, as when drafting
    begins after a prompt) plus its own chain rows j of depths 2..depth. True = may attend."""
    j = torch.arange(length, device=starts.device)
    first = (j[None, :] <= j[:, None])[None] & (j[None, None, :] >= starts[:, None, None])  # [B, T, T]
    first = first | torch.eye(length, dtype=torch.bool, device=starts.device)[None]  # never an empty row
    parts = [first] + [torch.eye(length, dtype=torch.bool, device=starts.device).expand_as(first)] * (depth - 1)
    return torch.cat(parts, dim=-1)[:, None]  # [B, 1, T, depth·T]


def train_forward(module: MTPModule, target: Transformer, tokens: torch.Tensor, hidden: torch.Tensor,
                  starts: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Teacher-forced chain over whole sequences: tokens [B, T], target last-layer hidden [B, T, H],
    starts [B] (first position the drafter has a row for). Returns per depth d = 1..depth the output
    hidden [B, T, H] whose row j predicts token j + d + 1 (rows past the end are padding)."""
    b, t = tokens.shape
    outs, past = [], None
    prev = hidden
    for d in range(1, depth + 1):
        nxt = torch.nn.functional.pad(tokens[:, d:], (0, d))  # [B, T]: token j + d
        with torch.no_grad():
            embedded = target.embed(nxt).float()  # [B, T, H]
        x = module.inputs(prev, embedded)  # [B, T, H]
        positions = torch.arange(t, device=tokens.device)[None].expand(b, t) + (d - 1)  # [B, T]
        out, new = module.run(x, positions, past, train_masks(starts, t, d))
        past = new if past is None else [(torch.cat([pk, k], 2), torch.cat([pv, v], 2))
                                          for (pk, pv), (k, v) in zip(past, new)]
        outs.append(out)
        prev = out
    return outs


class MTPDrafter(HiddenStateDrafterBase):
    """The Drafter protocol over an MTPModule (see the module docstring), or over any module with the
    same methods (inputs, run, target_hidden, logits; cfg.num_layers / num_kv_heads / head_dim): a
    checkpoint's own MTP head is one (engine.speculative.native_mtp)."""

    max_draft_tokens = None  # chained: any k (trained for module.cfg.block_size; deeper drafts are weaker)

    def __init__(self, module: MTPModule, target_loaded, max_seq_len: int | None = None, sampling=None,
                 name: str = "mtp", static: bool | None = None):
        """static: greedy proposals through engine.speculative.mtp_graph (fixed shapes, CUDA-graphed); default:
        on a GPU unless the embedding table is in host memory."""
        super().__init__(module, target_loaded, (-1,), max_seq_len, sampling, name)
        self.target: Transformer = target_loaded.model
        self.last = None  # (output hidden [H], position) of the newest committed row
        cuda = self.k.device.type == "cuda"
        if static is None:
            from engine.memory.host_embedding import HostEmbedding
            static = cuda and not isinstance(self.target.embed, HostEmbedding)
        self.static = StaticChain(self, self.picker.vocab, graphed=cuda) if static else None
        self.static_rows = MAX_ROWS  # commits of at most this many rows go through self.static (prepare)
        self._static_fresh = False  # the newest commit went through self.static (its buffers hold it)

    def prepare(self, k: int) -> None:
        """Capture now the graphs a run of at most k drafts replays (commits of 1..k+1 verified rows, chains of
        1..k drafts), not on a request's first steps; a commit of more rows (the prompt's) runs eagerly."""
        if self.static is None:
            return
        self.static_rows = min(k + 1, MAX_ROWS)
        hidden = torch.zeros(self.static_rows, self.static.out.shape[0], dtype=self.k.dtype, device=self.k.device)
        for n in range(1, self.static_rows + 1):  # into the cache's first rows: overwritten by the first commit
            self.static.commit(hidden[:n], [0] * n, list(range(n)), 0)
        for j in range(1, min(k, MAX_ROWS) + 1):
            self.static.chain(j)
        self._forget_last()

    def _forget_last(self) -> None:
        self.last, self._static_fresh = None, False

    def _commit(self, context: list[int]) -> None:
        new = self.rows.take(context)
        if new is None:
            return
        n = len(new.positions)
        if self.length + n > self.capacity:  # full: start over from these rows
            self.length = 0
        self._static_fresh = self.static is not None and n <= self.static_rows
        if self._static_fresh:
            out = self.static.commit(new.hidden[-1], new.next_tokens, new.positions, self.length)
            self.length += n
            self.last = (out, new.positions[-1])
            return
        device = self.k.device
        hidden = self.module.target_hidden(self.target, new.hidden[-1]).to(self.k.dtype)[None]  # [1, n, H]
        embedded = self.target.embed(torch.tensor([new.next_tokens], device=device)).to(self.k.dtype)  # [1, n, H]
        positions = torch.tensor([new.positions], device=device)  # [1, n]
        keys = torch.arange(self.length + n, device=device)
        mask = keys[None, :] <= (self.length + torch.arange(n, device=device))[:, None]  # [n, S + n]
        out, kv = self.module.run(self.module.inputs(hidden, embedded), positions, self._past(), mask[None, None])
        for i, (k, v) in enumerate(kv):
            self.k[i, :, :, self.length:self.length + n] = k
            self.v[i, :, :, self.length:self.length + n] = v
        self.length += n
        self.last = (out[0, -1], new.positions[-1])

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> Draft:
        self._commit(context)
        if k <= 0 or self.last is None or self.last[1] != len(context) - 2:
            return Draft([], None, self.name)
        if self._static_fresh and self.picker.sampling is None and k <= MAX_ROWS and self.length + k <= self.capacity:
            return Draft(self.static.chain(k), None, self.name)
        out, position = self.last
        tokens, probs = [], []
        past = self._past()
        device = self.k.device
        for step in range(k):
            token, prob = self.picker.pick(self.module.logits(self.target, out[None]))  # [1, V]
            tokens += token
            if prob is not None:
                probs.append(prob)
            if step == k - 1:
                break
            embedded = self.target.embed(torch.tensor(token, device=device)).to(out.dtype)  # [1, H]
            x = self.module.inputs(out[None], embedded)[None]  # [1, 1, H]
            position += 1
            y, kv = self.module.run(x, torch.tensor([[position]], device=device), past, None)
            past = [(torch.cat([pk, nk], 2), torch.cat([pv, nv], 2)) for (pk, pv), (nk, nv) in zip(past, kv)]
            out = y[0, -1]
        return Draft(tokens, torch.cat(probs) if probs else None, self.name)


def new_mtp_module(cfg: DrafterConfig, vocab_size: int, seed: int = 0) -> MTPModule:
    module = MTPModule(cfg, vocab_size)
    init_drafter_weights(module, seed)
    return module


def load_mtp_module(path, target_loaded) -> tuple[MTPModule, int]:
    """The trained module of a drafter file (checked against the target) and its training steps."""
    file = read_drafter(path, "mtp", TargetIdentity.of(target_loaded))
    module = MTPModule(file.config, target_loaded.config.vocab_size)
    module.load_state_dict(file.tensors)
    return module, file.step


def load_mtp_drafter(path, target_loaded, *, max_seq_len: int | None = None, sampling=None,
                     module=None) -> MTPDrafter:
    """module: one this file already gave (on the target's device), whose weights the drafter shares."""
    if module is None:
        module = to_target(load_mtp_module(path, target_loaded)[0], target_loaded)
    return MTPDrafter(module, target_loaded, max_seq_len=max_seq_len, sampling=sampling)
