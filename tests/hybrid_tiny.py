"""Tiny random Qwen3.5 hybrid models (Gated DeltaNet + gated attention): saved by transformers (the reference), or as
the engine's ModelConfig for generated weights."""
from __future__ import annotations

from pathlib import Path

import torch


def hybrid_config(**overrides):
    from transformers import Qwen3_5TextConfig
    args = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512,
                tie_word_embeddings=False)
    return Qwen3_5TextConfig(**(args | overrides))


def engine_hybrid_config(layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
                         vocab_size: int = 256):
    """The engine's ModelConfig of a tiny hybrid (DeltaNet heads 2 key / 4 value of 16, hidden 64), for generated
    weights (load_dummy) without transformers."""
    from engine.sources.hybrid_config import HybridConfig
    from engine.sources.model_config import ModelConfig
    return ModelConfig(architecture="qwen35", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_layers=len(layer_types), num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                       max_position_embeddings=256, hybrid=HybridConfig(tuple(layer_types), 2, 4, 16, 16))


def make_hybrid_model(path: Path, tokenizer_dir: Path | None = None, seed: int = 0, **overrides):
    """Save a random Qwen3_5ForCausalLM (norms and gates made non-trivial) to path; returns the HF model."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(hybrid_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return model


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """The HF model's logits [T, V] of ids, one full pass without a cache."""
    return model(torch.tensor([ids])).logits[0].float()


def tokenizer_dir(tmp_path_factory, gguf: Path) -> Path:
    """A Hugging Face tokenizer directory made from a GGUF's tokenizer (e.g. SmolLM2's, 49,152 tokens)."""
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


class MTPHead(torch.nn.Module):
    """A Qwen3.5 MTP head made of transformers' own pieces (vLLM's Qwen3_5MultiTokenPredictor layout:
    fc over [normed embedding ; normed hidden], one full-attention decoder layer, a final norm)."""

    def __init__(self, config, seed: int = 1):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
        super().__init__()
        h = config.hidden_size
        full = config.layer_types.index("full_attention")
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, config.rms_norm_eps)
        self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(config, full)])
        self.norm = Qwen3_5RMSNorm(h, config.rms_norm_eps)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 1 else 0.3))


def add_mtp_head(path: Path, model, seed: int = 1) -> MTPHead:
    """Write an MTP head's tensors (mtp.*) next to a saved tiny hybrid and declare it in config.json."""
    import json

    from safetensors.torch import save_file
    head = MTPHead(model.config, seed).eval()
    save_file({f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()}, str(path / "model-mtp.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"mtp_num_hidden_layers": 1}, indent=2))
    return head


@torch.no_grad()
def reference_mtp_logits(model, head: MTPHead, ids: list[int], start: int, chain: list[int]) -> torch.Tensor:
    """The head's logits [1 + len(chain), V], vLLM's way: row p (p = start .. len(ids) - 2) reads the
    model's final hidden state of position p and the embedding of token p + 1, at position p, causal over
    those rows; the last row's logits, then one more per chained token (its input: the previous row's
    normed output and the chained token, one position on)."""
    hidden = model.model(torch.tensor([ids])).last_hidden_state[0]  # [T, H], after the final norm
    prev = hidden[start:len(ids) - 1]  # [n, H]
    tokens = list(ids[start + 1:])
    out_logits = []
    rows_hidden, rows_tokens = prev, tokens
    for step in range(len(chain) + 1):
        n = rows_hidden.shape[0]
        emb = model.model.embed_tokens(torch.tensor([rows_tokens]))[0]  # [n, H]
        x = head.fc(torch.cat([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(rows_hidden)], -1))[None]
        positions = torch.arange(start, start + n)[None]
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]  # [1, 1, n, n], whatever the attention kind
        x = head.layers[0](x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=causal,
                           position_ids=positions)
        out = head.norm(x)[0]  # [n, H]
        out_logits.append(model.lm_head(out[-1]).float())
        if step < len(chain):  # one more row: the chained token after the last row's output
            rows_hidden = torch.cat([rows_hidden, out[-1:]])
            rows_tokens = rows_tokens + [chain[step]]
    return torch.stack(out_logits)
