"""Writes small Hugging Face Llama directories (random weights, SmolLM2's tokenizer cut to 1024 tokens)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.sources.gguf_file import GGUFFile
from engine.sources.tokenizer import Tokenizer


def tokenizer_files(tiny_gguf: Path) -> dict[str, str]:
    """The tiny GGUF's tokenizer as HF files (tokenizer.json, tokenizer_config.json, generation_config.json)."""
    return Tokenizer.from_gguf_metadata(GGUFFile(tiny_gguf).metadata).hf_files()


def write_tiny_hf(path: Path, tiny_gguf: Path, hidden: int = 64, ffn: int = 128, layers: int = 2, heads: int = 4,
                  kv_heads: int = 2, vocab: int = 1024, tied: bool = False, seed: int = 0,
                  layers_per_shard: int = 0) -> Path:
    """config.json, model.safetensors (or one shard per `layers_per_shard` layers) and tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": tied,
              "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in tokenizer_files(tiny_gguf).items():
        (path / name).write_text(text)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (0.5 / shape[-1] ** 0.5 if len(shape) == 2 else 0.1) + (len(shape) == 1)

    def layer(i: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{i}."
        return {p + "input_layernorm.weight": rnd(hidden), p + "post_attention_layernorm.weight": rnd(hidden),
                p + "self_attn.q_proj.weight": rnd(heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": rnd(kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": rnd(kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": rnd(hidden, heads * head_dim),
                p + "mlp.gate_proj.weight": rnd(ffn, hidden), p + "mlp.up_proj.weight": rnd(ffn, hidden),
                p + "mlp.down_proj.weight": rnd(hidden, ffn)}

    top = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g) * 0.5, "model.norm.weight": rnd(hidden)}
    if not tied:
        top["lm_head.weight"] = rnd(vocab, hidden)
    if not layers_per_shard:
        tensors = dict(top)
        for i in range(layers):
            tensors.update(layer(i))
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    groups = [list(range(i, min(i + layers_per_shard, layers))) for i in range(0, layers, layers_per_shard)]
    weight_map = {}
    for n, group in enumerate([None, *groups]):
        tensors = top if group is None else {k: v for i in group for k, v in layer(i).items()}
        file = f"model-{n + 1:05d}-of-{len(groups) + 1:05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def write_lora(path: Path, targets: dict[str, tuple[int, int]], r: int = 4, alpha: float = 8.0, seed: int = 1
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A PEFT-layout LoRA adapter for `targets` (HF weight name → (out, in)); returns name → (A, B)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    pairs, tensors = {}, {}
    for name, (out_features, in_features) in targets.items():
        a, b = torch.randn(r, in_features, generator=g) * 0.1, torch.randn(out_features, r, generator=g) * 0.1
        module = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = a, b
        pairs[name] = (a, b)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    modules = sorted({n.split(".")[-2] for n in targets})
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                                          "target_modules": modules}))
    return pairs
