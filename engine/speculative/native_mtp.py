"""The MTP head a Qwen3.5 / Qwen3.6 checkpoint ships with, as a drafter (`--spec mtp` without a path).

The module (vLLM's Qwen3_5MultiTokenPredictor, facts in engine.sources.mtp_source): the target's hidden
state of position p after its final norm (what vLLM hands its MTP proposer) and the embedding of token
p + 1, each RMS-normed, concatenated [embedding ; hidden] and projected by `fc`; one full-attention
decoder layer of the target's own kind (DraftBlock with the target's config: gated attention, q/k
norms, partial rotary, its MLP); the head's final norm; the target's LM head. Its normed output is
both the logits' input and the hidden state of the next chained step, so k drafts come from k
recursions of the one layer. The drafting loop is engine.speculative.mtp.MTPDrafter's.

Only heads of one layer are run (Qwen3.5 / 3.6 ship `mtp_num_hidden_layers` = 1); its weights stay
in the target's float dtype (~0.8 GB in bfloat16 for the 27B shape; the memory plan counts them).

Factory: load_native_mtp_drafter(target_loaded, *, max_seq_len=None, sampling=None) -> MTPDrafter
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import BonsaiError
from engine.runtime.model import Linear, RMSNorm, Transformer, rotary_inverse_frequencies
from engine.sources.model_config import ModelConfig
from engine.speculative.draft_layers import DraftBlock, rotary
from engine.speculative.hidden_drafter import PROMPT_ROWS
from engine.speculative.mtp import MTPDrafter


@dataclass(frozen=True)
class NativeMTPShape:
    """What the drafting loop needs of a module's shape (its KV cache is [L, 1, KV, S, D])."""
    num_layers: int
    num_kv_heads: int
    head_dim: int


class NativeMTPModule(nn.Module):
    def __init__(self, target: ModelConfig, num_layers: int = 1):
        super().__init__()
        if num_layers != 1:
            raise BonsaiError(f"this model's MTP head has {num_layers} layers; bonsai runs heads of one layer "
                              "(Qwen3.5 / Qwen3.6 ship one): use --spec ngram or a trained drafter (mtp:PATH)")
        h = target.hidden_size
        self.cfg = NativeMTPShape(num_layers, target.num_kv_heads, target.head_dim)
        self.embed_norm = RMSNorm(h, target.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, target.rms_norm_eps)
        self.proj = Linear(2 * h, h)
        self.blocks = nn.ModuleList(DraftBlock(target) for _ in range(num_layers))
        self.norm = RMSNorm(h, target.rms_norm_eps)
        self.register_buffer("inv_freq", rotary_inverse_frequencies(target), persistent=False)

    def target_hidden(self, target: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        """The target's last-block output [.., H] after its final norm (the head was trained on that)."""
        return target.norm(hidden.to(target.norm.weight.dtype))

    def inputs(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[.., H] hidden state and [.., H] embedding of the next token → block input [.., H]."""
        return self.proj(torch.cat([self.embed_norm(embedded), self.hidden_norm(hidden)], dim=-1))

    def run(self, x: torch.Tensor, positions: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None,
            mask: torch.Tensor | None) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """x [B, T, H] at positions [B, T] after `past` (per layer: k, v [B, KV, S, D]) → (the normed
        output [B, T, H], per layer the new rows' k, v)."""
        cos, sin = rotary(positions, self.inv_freq)
        new = []
        for i, block in enumerate(self.blocks):
            pk, pv = past[i] if past is not None else (None, None)
            x, k, v = block(x, cos, sin, pk, pv, mask)
            new.append((k, v))
        return self.finish(x), new

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks' output [.., H] → the head's normed output (its logits' input and the next step's hidden)."""
        return self.norm(x)

    def logits(self, target: Transformer, out: torch.Tensor) -> torch.Tensor:
        """Logits [.., V] (float32) of normed outputs [.., H]: the target's LM head alone."""
        return target.output(out.to(target.norm.weight.dtype)).float()

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Tensors by engine.sources.mtp_source's short names (HF convention: norms as w of x·(1 + w))."""
        top = {"fc.weight": self.proj.weight, "pre_fc_norm_embedding.weight": self.embed_norm.weight,
               "pre_fc_norm_hidden.weight": self.hidden_norm.weight, "norm.weight": self.norm.weight}
        wanted = set(top) | {n for n in _layer_names(self)}
        missing = sorted(wanted - set(tensors))
        if missing:
            raise BonsaiError(f"the model's MTP head lacks {len(missing)} tensor(s), e.g. mtp.{missing[0]}: "
                              "its files are incomplete; use --spec ngram or a trained drafter (mtp:PATH)")
        for name, tensor in tensors.items():
            if name in top:
                _copy(top[name], tensor if name == "fc.weight" else tensor + 1, name)  # the norms: 1 + w
                continue
            _, i, part, kind = name.split(".")
            block = self.blocks[int(i)]
            if part in _CENTRED:
                tensor = tensor + 1
            cfg = block.cfg
            rows = {"q_proj": (0, cfg.q_rows), "k_proj": (cfg.q_rows, cfg.kv_size),
                    "v_proj": (cfg.q_rows + cfg.kv_size, cfg.kv_size),
                    "gate_proj": (0, cfg.intermediate_size), "up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
            if part in rows:
                start, n = rows[part]
                fused = block.attention.wqkv if part.endswith(("q_proj", "k_proj", "v_proj")) else block.feed_forward.w13
                _copy(getattr(fused, kind)[start:start + n], tensor, name)
                continue
            target = {"o_proj": block.attention.wo.weight, "down_proj": block.feed_forward.w2.weight,
                      "input_layernorm": block.attention_norm.weight, "post_attention_layernorm": block.ffn_norm.weight,
                      "q_norm": getattr(block.attention.q_norm, "weight", None),
                      "k_norm": getattr(block.attention.k_norm, "weight", None)}.get(part)
            if target is None:
                raise BonsaiError(f"the model's MTP head has a tensor bonsai does not know: mtp.{name}")
            _copy(target, tensor, name)


_CENTRED = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")


def _layer_names(module: NativeMTPModule) -> list[str]:
    names = []
    for i, block in enumerate(module.blocks):
        parts = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 "input_layernorm", "post_attention_layernorm"]
        if block.attention.q_norm is not None:
            parts += ["q_norm", "k_norm"]
        names += [f"layers.{i}.{p}.weight" for p in parts]
    return names


def _copy(target: torch.Tensor, source: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(source.shape):
        raise BonsaiError(f"the model's MTP tensor mtp.{name} has shape {tuple(source.shape)}, the model "
                          f"expects {tuple(target.shape)}: the head does not belong to this model")
    target.copy_(source)


def native_mtp_numel(config: ModelConfig) -> int:
    """Parameters of a one-layer native MTP head of `config` (what the memory plan counts)."""
    h = config.hidden_size
    shapes = config.layer_linear_shapes(next(i for i in range(config.num_layers) if not config.is_linear(i)))
    linear = sum(o * i for o, i in shapes.values())
    norms = 2 * h + (2 * config.head_dim if config.qk_norm else 0)
    return 2 * h * h + 3 * h + linear + norms


def random_native_mtp(module: NativeMTPModule, seed: int = 0) -> None:
    """Generated weights for a dummy model (`--load-format dummy`): the speed of drafting, not its quality."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.02)


def load_native_mtp_drafter(target_loaded, *, max_seq_len: int | None = None, sampling=None,
                            module: NativeMTPModule | None = None) -> MTPDrafter:
    """The target's own MTP head as a drafter (`module`: one already loaded, whose weights it shares);
    refused in one line when the target's files hold none."""
    if module is None:
        module = load_native_mtp_module(target_loaded)
    drafter = MTPDrafter(module, target_loaded, max_seq_len=max_seq_len, sampling=sampling, name="mtp")
    drafter.prompt_rows = PROMPT_ROWS  # trained over whole sequences (vLLM runs it over the prompt too)
    return drafter


def load_native_mtp_module(target_loaded) -> NativeMTPModule:
    """The target's MTP head on its device and dtype (generated weights for a dummy target)."""
    from engine.sources.mtp_source import mtp_layer_count, read_mtp_tensors
    from engine.weights.loader import open_model_source
    config = target_loaded.config
    if config.hybrid is None:
        raise BonsaiError(f"--spec mtp without a file runs a Qwen3.5 / Qwen3.6 checkpoint's own MTP head; "
                          f"{config.architecture} models have none: train one (`bonsai train-drafter MODEL --kind "
                          "mtp --out DIR`) and give mtp:DIR")
    if target_loaded.summary.format == "dummy":
        module = NativeMTPModule(config)
        random_native_mtp(module)
    else:
        source = open_model_source(target_loaded.path)
        layers = mtp_layer_count(source, config.num_layers)
        if layers == 0:
            raise BonsaiError(f"{target_loaded.path} has no MTP head (no mtp.* tensors; a conversion may have "
                              "dropped them): use --spec ngram, or a trained drafter mtp:PATH")
        module = NativeMTPModule(config, layers)
        module.load(read_mtp_tensors(source, config))
    inv_freq = module.inv_freq
    module = module.to(device=target_loaded.device, dtype=target_loaded.dtype).eval()
    module.inv_freq = inv_freq.to(target_loaded.device)
    return module
