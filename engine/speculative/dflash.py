"""DFlash-style block drafter: a few non-causal transformer layers draft a whole block in one pass.

Hidden states from several target layers are concatenated, projected and normalized into one
context feature per verified position; each drafter layer turns those features into keys/values
(its own k/v projections, rotary at their positions) that the block attends to. The block is
[bonus token, mask, mask, ...] (block_size + 1 rows, fully visible to each other); row i's output
goes through the target's final norm + LM head and predicts the token at its position. The token
embedding and LM head are the target's; the mask token is a learned vector.

Factory (what `--spec dflash:PATH` calls):
    load_dflash_drafter(path, target_loaded, *, k=None, max_seq_len=None, sampling=None) -> DFlashDrafter
      path: a drafter file (or its directory) from `bonsai train-drafter --kind dflash`; refused in
      one line if trained for another model. k: the draft length the caller will ask for; larger
      than the trained block size → one BonsaiError here, before generation starts (propose raises
      the same error). max_seq_len: rows of its context cache (default: the target's context, at
      most 4096). sampling: as in engine.speculative.mtp.
`max_draft_tokens` on the drafter is its block size. Context rows exist from the first verification on.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.errors import BonsaiError
from engine.runtime.model import Linear, RMSNorm, Transformer
from engine.speculative.draft_layers import (DraftBlock, DrafterConfig, drafter_inverse_frequencies,
                                             init_drafter_weights, rotary, shared_logits, to_target)
from engine.speculative.drafter import Draft
from engine.speculative.drafter_file import TargetIdentity, read_drafter
from engine.speculative.hidden_drafter import HiddenStateDrafterBase


class DFlashModule(nn.Module):
    def __init__(self, cfg: DrafterConfig, vocab_size: int):
        super().__init__()
        assert cfg.kind == "dflash"
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layers) * h, h)
        self.context_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))
        block_cfg = cfg.block_config(vocab_size)
        self.blocks = nn.ModuleList(DraftBlock(block_cfg) for _ in range(cfg.num_layers))
        self.register_buffer("inv_freq", drafter_inverse_frequencies(cfg, vocab_size), persistent=False)

    def context(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """{target layer: [.., H]} → fused context features [.., H]."""
        return self.context_norm(self.fc(torch.cat([hidden[i] for i in self.cfg.target_layers], dim=-1)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer keys/values [B, KV, S, D] of context features [B, S, H] at positions [B, S]."""
        cos, sin = rotary(positions, self.inv_freq)
        return [block.key_values(features, cos, sin) for block in self.blocks]

    def block_inputs(self, embedded_first: torch.Tensor, size: int) -> torch.Tensor:
        """[.., H] embeddings of the bonus tokens → [.., size + 1, H]: the bonus then `size` masks."""
        masks = self.mask_embedding.to(embedded_first.dtype).expand(*embedded_first.shape[:-1], size, -1)
        return torch.cat([embedded_first.unsqueeze(-2), masks], dim=-2)

    def run(self, x: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
            mask: torch.Tensor | None) -> torch.Tensor:
        """Blocks x [B, T, H] at positions [B, T] attending to context keys/values and each other."""
        cos, sin = rotary(positions, self.inv_freq)
        for block, (ck, cv) in zip(self.blocks, context):
            x, _, _ = block(x, cos, sin, ck, cv, mask)
        return x


def train_mask(starts: torch.Tensor, anchors: torch.Tensor, length: int, size: int) -> torch.Tensor:
    """Mask [B, 1, nb·(size+1), length + nb·(size+1)] for blocks at anchors [B, nb] (the bonus
    positions): a block sees context rows start..anchor-1 and all rows of its own block."""
    b, nb = anchors.shape
    rows = size + 1
    p = torch.arange(length, device=anchors.device)
    ctx = (p[None, None] >= starts[:, None, None]) & (p[None, None] < anchors[:, :, None])  # [B, nb, S]
    ctx = ctx[:, :, None, :].expand(b, nb, rows, length).reshape(b, nb * rows, length)
    own = torch.block_diag(*[torch.ones(rows, rows, dtype=torch.bool, device=anchors.device)] * nb)
    return torch.cat([ctx, own[None].expand(b, -1, -1)], dim=-1)[:, None]


def train_forward(module: DFlashModule, target: Transformer, tokens: torch.Tensor, hidden: dict[int, torch.Tensor],
                  starts: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """tokens [B, T], {layer: [B, T, H]}, starts [B], anchors [B, nb] → outputs [B, nb, size, H]
    whose row i (0-based) predicts the token at anchor + 1 + i."""
    b, t = tokens.shape
    size = module.cfg.block_size
    nb = anchors.shape[1]
    features = module.context(hidden)  # [B, T, H]
    positions = torch.arange(t, device=tokens.device)[None].expand(b, t)  # [B, T]
    context = module.context_kv(features, positions)
    with torch.no_grad():
        first = target.embed(tokens.gather(1, anchors)).float()  # [B, nb, H]
    x = module.block_inputs(first, size).reshape(b, nb * (size + 1), -1)  # [B, nb·(size+1), H]
    block_pos = (anchors[:, :, None] + torch.arange(size + 1, device=tokens.device)).reshape(b, -1)  # [B, nb·(size+1)]
    out = module.run(x, block_pos, context, train_mask(starts, anchors, t, size))
    return out.reshape(b, nb, size + 1, -1)[:, :, 1:]  # [B, nb, size, H]


class DFlashDrafter(HiddenStateDrafterBase):
    """The Drafter protocol over a DFlashModule (see the module docstring)."""

    def __init__(self, module: DFlashModule, target_loaded, max_seq_len: int | None = None, sampling=None,
                 name: str = "dflash"):
        super().__init__(module, target_loaded, module.cfg.target_layers, max_seq_len, sampling, name)
        self.target: Transformer = target_loaded.model
        self.max_draft_tokens = module.cfg.block_size
        self.last_position = None  # position of the newest context row

    def _forget_last(self) -> None:
        self.last_position = None

    def check_draft_length(self, k: int) -> None:
        if k > self.max_draft_tokens:
            raise BonsaiError(f"draft length {k} is larger than this DFlash drafter's block size "
                              f"{self.max_draft_tokens}: ask for at most {self.max_draft_tokens} tokens, or train one "
                              f"with --block-size {k}")

    def _commit(self, context: list[int]) -> None:
        new = self.rows.take(context)
        if new is None:
            return
        n = len(new.positions)
        if self.length + n > self.capacity:
            self.length = 0
        device = self.k.device
        features = self.module.context({i: h.to(self.k.dtype)[None] for i, h in new.hidden.items()})  # [1, n, H]
        kv = self.module.context_kv(features, torch.tensor([new.positions], device=device))
        for i, (k, v) in enumerate(kv):
            self.k[i, :, :, self.length:self.length + n] = k
            self.v[i, :, :, self.length:self.length + n] = v
        self.length += n
        self.last_position = new.positions[-1]

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> Draft:
        self.check_draft_length(k)
        self._commit(context)
        if k <= 0 or self.last_position != len(context) - 2:
            return Draft([], None, self.name)
        device = self.k.device
        size = self.max_draft_tokens
        first = self.target.embed(torch.tensor([context[-1]], device=device)).to(self.k.dtype)  # [1, H]
        x = self.module.block_inputs(first, size)  # [1, size + 1, H]
        positions = torch.arange(len(context) - 1, len(context) + size, device=device)[None]  # [1, size + 1]
        past = [(self.k[i, :, :, :self.length], self.v[i, :, :, :self.length]) for i in range(self.k.shape[0])]
        out = self.module.run(x, positions, past, None)  # [1, size + 1, H]
        tokens, probs = self.picker.pick(shared_logits(self.target, out[0, 1:k + 1]))  # [k, V]
        return Draft(tokens, probs, self.name)


def new_dflash_module(cfg: DrafterConfig, vocab_size: int, seed: int = 0) -> DFlashModule:
    module = DFlashModule(cfg, vocab_size)
    init_drafter_weights(module, seed)
    return module


def load_dflash_module(path, target_loaded) -> tuple[DFlashModule, int]:
    file = read_drafter(path, "dflash", TargetIdentity.of(target_loaded))
    module = DFlashModule(file.config, target_loaded.config.vocab_size)
    module.load_state_dict(file.tensors)
    return module, file.step


def load_dflash_drafter(path, target_loaded, *, k: int | None = None, max_seq_len: int | None = None,
                        sampling=None, module=None) -> DFlashDrafter:
    """module: one this file already gave (on the target's device), whose weights the drafter shares."""
    if module is None:
        module = to_target(load_dflash_module(path, target_loaded)[0], target_loaded)
    drafter = DFlashDrafter(module, target_loaded, max_seq_len, sampling)
    if k is not None:
        drafter.check_draft_length(k)
    return drafter

