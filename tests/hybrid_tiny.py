"""Tiny random Qwen3.5 hybrid models (Gated DeltaNet + gated attention) saved by transformers, the reference."""
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
