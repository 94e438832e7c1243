"""Training a drafter (MTP or DFlash) for a frozen target: the loss, the loop, checkpoints, resume.

The target never changes; the data (engine.speculative.drafter_data) holds its hidden states and
next-token distributions. The loss is the cross-entropy of the drafter's prediction against the
target's distribution at the same position ("kl": its top-k renormalized, which is the KL up to a
constant; "ce": its argmax only, the greedy acceptance objective), weighted 0.8^(i-1) at draft
position i (later drafts only count when the earlier ones were accepted). `train_vocab = "data"`
restricts the output layer during training to the ids the data can ask for (all targets, a few
thousand rows: ~10x cheaper on a CPU); drafting always uses the full LM head.

Files in the output directory, each written atomically: drafter.safetensors (the drafter, read by
the factories in mtp.py / dflash.py), train_state.pt (module, optimizer, step: what --resume reads),
data.pt (the training data, so a resumed run trains on the same sequences).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.errors import BonsaiError
from engine.runtime.runner import ModelRunner
from engine.speculative import dflash, mtp
from engine.speculative.draft_layers import DrafterConfig, default_config, shared_logits, to_target
from engine.speculative.drafter_data import DrafterData
from engine.speculative.drafter_eval import AcceptanceStats, measure_acceptance
from engine.speculative.drafter_file import TargetIdentity, atomic_write, save_drafter

POSITION_DECAY = 0.8
STATE_FILE, DATA_FILE = "train_state.pt", "data.pt"


@dataclass(frozen=True)
class TrainConfig:
    kind: str
    steps: int
    block_size: int | None = None  # MTP: chained depth (default 3); DFlash: block (default 8)
    lr: float = 1e-3
    batch: int = 8
    seq_len: int = 128
    loss: str = "kl"  # kl | ce
    train_vocab: str = "data"  # data | full
    num_layers: int | None = None  # drafter blocks (MTP 1, DFlash 2)
    intermediate_size: int | None = None  # drafter FFN width (default half the target's)
    blocks_per_sequence: int = 4  # DFlash: blocks trained per sequence and step
    checkpoint_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [(self.kind in ("mtp", "dflash"), f"--kind must be mtp or dflash, not '{self.kind}'"),
                  (self.steps >= 0, "--steps must be >= 0"), (self.lr > 0, "--lr must be > 0"),
                  (self.batch >= 1, "--batch must be >= 1"), (self.seq_len >= 8, "--seq-len must be >= 8"),
                  (self.loss in ("kl", "ce"), f"--loss must be kl or ce, not '{self.loss}'"),
                  (self.train_vocab in ("data", "full"), f"--train-vocab must be data or full, not '{self.train_vocab}'"),
                  (self.block_size is None or 1 <= self.block_size <= 64, "--block-size must be in 1..64"),
                  (self.blocks_per_sequence >= 1, "blocks_per_sequence must be >= 1"),
                  (self.checkpoint_every >= 1, "checkpoint_every must be >= 1")]
        for ok, message in checks:
            if not ok:
                raise BonsaiError(message)
        if self.block_size is None:
            object.__setattr__(self, "block_size", 3 if self.kind == "mtp" else 8)
        if self.block_size + 2 > self.seq_len // 2:
            raise BonsaiError(f"--block-size {self.block_size} needs --seq-len of at least {2 * (self.block_size + 2)}")

    def drafter_config(self, target_config) -> DrafterConfig:
        return default_config(self.kind, target_config, self.block_size, self.num_layers, self.intermediate_size)


@dataclass
class TrainResult:
    step: int
    seconds: float
    loss: float
    top1: float  # share of trained rows whose argmax equals the target's (last logged window)
    out: Path


def new_module(cfg: DrafterConfig, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    return (mtp.new_mtp_module if cfg.kind == "mtp" else dflash.new_dflash_module)(cfg, vocab_size, seed)


def make_drafter(module: torch.nn.Module, target_loaded, **opts):
    """A Drafter over a (trained or fresh) module, on the target's device and dtype."""
    copy = new_module(module.cfg, target_loaded.config.vocab_size)
    copy.load_state_dict(module.state_dict())
    cls = mtp.MTPDrafter if module.cfg.kind == "mtp" else dflash.DFlashDrafter
    return cls(to_target(copy, target_loaded), target_loaded, **opts)


def soft_cross_entropy(logits: torch.Tensor, target_ids: torch.Tensor, target_probs: torch.Tensor,
                       weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., S]; target_ids/probs [..., K] (ids index the last dim; probs sum to 1); weights
    [...] (0 = not trained). Returns the weighted mean of -Σ p log q and the top-1 match per row."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    ce = -(logq.gather(-1, target_ids) * target_probs).sum(-1)  # [...]
    top1 = (logits.argmax(-1) == target_ids[..., 0]).float()
    return (ce * weights).sum() / weights.sum().clamp_min(1e-9), top1


class Trainer:
    def __init__(self, target_loaded, data: DrafterData, cfg: TrainConfig, module: torch.nn.Module):
        self.target = target_loaded.model
        self.loaded = target_loaded
        self.data, self.cfg, self.module = data, cfg, module
        self.device = target_loaded.device
        vocab = target_loaded.config.vocab_size
        if cfg.train_vocab == "data":
            rows = data.vocab_rows()
            lookup = torch.full((vocab,), -1, dtype=torch.long)
            lookup[rows] = torch.arange(len(rows))
            self.rows, self.lookup = rows.to(self.device), lookup
        else:
            self.rows, self.lookup = None, torch.arange(vocab)
        for p in self.target.parameters():
            p.requires_grad_(False)

    def targets(self, idx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's distributions at positions [B, ...] of sequences idx [B]: ids [B, ..., K]
        (mapped to the training vocabulary) and probabilities [B, ..., K]."""
        k = 1 if self.cfg.loss == "ce" else self.data.top_ids.shape[-1]
        b = idx.shape[0]
        flat = positions.reshape(b, -1).clamp(0, self.data.tokens.shape[1] - 1)  # [B, P]
        ids = self.data.top_ids[idx[:, None], flat][..., :k]  # [B, P, K]
        probs = self.data.top_probs[idx[:, None], flat][..., :k]
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)
        shape = (*positions.shape, k)
        return self.lookup[ids].reshape(shape).to(self.device), probs.reshape(shape).to(self.device)

    def loss(self, idx: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, float]:
        data, dev = self.data, self.device
        crop = int(data.starts[idx].min())  # nothing before a sequence's start is seen: drop what none sees
        tokens = data.tokens[idx, crop:].to(dev)  # [B, T]
        starts, lengths = data.starts[idx] - crop, data.lengths[idx] - crop
        b, t = tokens.shape
        size = self.cfg.block_size
        decay = torch.tensor([POSITION_DECAY ** i for i in range(size)], device=dev)
        if self.cfg.kind == "mtp":
            outs = mtp.train_forward(self.module, self.target, tokens, data.hidden[-1][idx, crop:].to(dev),
                                     starts.to(dev), size)
            out = torch.stack(outs, dim=2)  # [B, T, depth, H]: row j, depth d predicts token j + d + 1
            j = torch.arange(t)[None, :, None]
            d = torch.arange(1, size + 1)[None, None, :]
            positions = j + d  # [1, T, depth]: the target's distribution at j + d
            valid = (j >= starts[:, None, None]) & (positions <= lengths[:, None, None] - 1)  # [B, T, depth]
            positions = positions.expand(b, -1, -1)
        else:
            low = starts + 1  # at least one context row before the block
            high = lengths - size  # the last anchor whose targets exist
            span = (high - low + 1).clamp_min(1)
            anchors = low[:, None] + (torch.rand(b, self.cfg.blocks_per_sequence, generator=generator)
                                      * span[:, None]).long()  # [B, nb]
            anchors = torch.minimum(anchors, (lengths - 1)[:, None]).clamp_min(0)
            hidden = {i: data.hidden[i][idx, crop:].to(dev) for i in self.module.cfg.target_layers}
            out = dflash.train_forward(self.module, self.target, tokens, hidden, starts.to(dev), anchors.to(dev))
            positions = anchors[:, :, None] + torch.arange(size)[None, None]  # [B, nb, size]
            valid = (high >= low)[:, None, None].expand_as(positions)
        weights = valid.to(dev).float() * decay  # [B, ..., size]
        target_ids, target_probs = self.targets(idx, positions + crop)
        logits = shared_logits(self.target, out, self.rows)  # [B, ..., size, S]
        loss, top1 = soft_cross_entropy(logits, target_ids, target_probs, weights)
        first = valid[..., 0].to(dev)
        return loss, float(top1[..., 0][first].mean()) if first.any() else 0.0


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over the first 10% (at most 100 steps), then cosine down to 10%."""
    warm = max(1, min(100, cfg.steps // 10))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train_drafter(target_loaded, data: DrafterData, cfg: TrainConfig, out_dir: Path, resume: bool = False,
                  on_step: Callable[[int, int, float, float], None] | None = None) -> tuple[torch.nn.Module, TrainResult]:
    """Train (or continue training) a drafter into out_dir; checkpoints every cfg.checkpoint_every
    steps and at the end. on_step(step, total, loss, top1) after every step."""
    out_dir = Path(out_dir)
    dcfg = cfg.drafter_config(target_loaded.config)
    identity = TargetIdentity.of(target_loaded)
    state_path = out_dir / STATE_FILE
    module = new_module(dcfg, target_loaded.config.vocab_size, cfg.seed).to(target_loaded.device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    step = 0
    if resume:
        if not state_path.exists():
            raise BonsaiError(f"nothing to resume in {out_dir}: no {STATE_FILE} (run without --resume first)")
        state = torch.load(state_path, weights_only=True, map_location=target_loaded.device)
        if state["drafter_config"] != dcfg.to_dict() or state["target"] != asdict(identity):
            raise BonsaiError(f"{out_dir} holds the training of another drafter or model; use the same MODEL, "
                              "--kind and sizes as the first run, or another --out")
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    elif state_path.exists():
        raise BonsaiError(f"{out_dir} already holds a drafter training: add --resume to continue it, or choose "
                          "another --out")
    trainer = Trainer(target_loaded, data, cfg, module)
    loss_value, top1, started = float("nan"), 0.0, time.perf_counter()

    def checkpoint() -> None:
        state = {"module": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                 "drafter_config": dcfg.to_dict(), "target": asdict(identity), "train_config": asdict(cfg)}
        atomic_write(state_path, lambda tmp: torch.save(state, tmp))
        save_drafter(out_dir, dcfg, identity, module.state_dict(), step)

    module.train()
    while step < cfg.steps:
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # the same batches on resume
        idx = torch.randint(0, data.num_sequences, (min(cfg.batch, data.num_sequences),), generator=generator)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(cfg, step)
        loss, top1 = trainer.loss(idx, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        step += 1
        loss_value = float(loss.detach())
        if on_step:
            on_step(step, cfg.steps, loss_value, top1)
        if step % cfg.checkpoint_every == 0 and step < cfg.steps:
            checkpoint()
    checkpoint()
    module.eval()
    return module, TrainResult(step, time.perf_counter() - started, loss_value, top1, out_dir)


def drafter_acceptance(target_loaded, module: torch.nn.Module, data: DrafterData, max_new_tokens: int = 64,
                       k: int | None = None) -> AcceptanceStats:
    """Greedy acceptance of `module` drafting k tokens (default its block size) per step against the
    target on the data's held-out prompts."""
    k = k or module.cfg.block_size
    longest = max(len(p) for p in data.eval_prompts)
    runner = ModelRunner(target_loaded, max_seq_len=longest + max_new_tokens + k + 2)
    drafter = make_drafter(module, target_loaded, max_seq_len=runner.max_seq_len)
    return measure_acceptance(runner, drafter, data.eval_prompts, max_new_tokens, k, target_loaded.tokenizer)
