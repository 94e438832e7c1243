"""What every command checks of a model file before it allocates anything: the architecture it
declares (engine.sources.model_limits), then its tensor inventory against that architecture (the layer
count first, then every tensor the model needs, with the shape it needs). `bonsai info`,
`generate`, `serve` and the memory plan all go through a source's `model_config()`, which runs
these, so a file one of them refuses the others refuse too, in the same one line naming the file."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

from engine.errors import BonsaiError, ModelFileError
from engine.sources.model_config import ModelConfig

T = TypeVar("T")


def in_file(path: Path | str, read: Callable[[], T]) -> T:
    """read(); a BonsaiError it raises says which file (once)."""
    try:
        return read()
    except BonsaiError as e:
        if str(path) in str(e):
            raise
        raise type(e)(f"{path}: {e}") from None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """canonical tensor name → the shape the loader copies it into (engine.model.Transformer.load_tensor)."""
    h, q, kv, f = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    out: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (config.vocab_size, h), "norm.weight": (h,)}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    block = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj.weight": (h, q),
             "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f)}
    if config.qk_norm:
        block |= {"q_norm.weight": (config.head_dim,), "k_norm.weight": (config.head_dim,)}
    if config.attention_bias:
        block |= {"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)}
    hc = config.hybrid
    for i in range(config.num_layers):
        if hc is None:
            out |= {f"layers.{i}.{part}": shape for part, shape in block.items()}
            continue
        # qwen35: gated attention (q_proj also yields the gate) or DeltaNet, by layer_types
        shapes = {f"{p}.weight": shape for p, shape in config.layer_linear_shapes(i).items()}
        if hc.is_linear(i):
            shapes |= {"conv1d.weight": (hc.conv_dim, 1, hc.conv_kernel), "dt_bias.param": (hc.linear_num_value_heads,),
                       "A_log.param": (hc.linear_num_value_heads,), "linear_norm.weight": (hc.linear_value_head_dim,)}
        else:
            shapes |= {p: block[p] for p in block if not p.endswith("proj.weight")}  # norms (and biases)
        shapes |= {p: block[p] for p in ("input_layernorm.weight", "post_attention_layernorm.weight")}
        out |= {f"layers.{i}.{part}": shape for part, shape in shapes.items()}
    return out


def check_tensors(path: Path | str, config: ModelConfig, found: dict[str, tuple[str, tuple[int, ...]]],
                  spell: Callable[[str], str], layer_key: str) -> None:
    """found: canonical name → (the file's name of it, its shape); spell: the file's name of a
    canonical one; layer_key: the file's key for the layer count. Raises ModelFileError, one line."""
    layers = {int(name.split(".")[1]) for name in found if name.startswith("layers.")}
    held = max(layers) + 1 if layers else 0
    if held != config.num_layers:
        raise ModelFileError(f"{path}: {layer_key} is {config.num_layers} but the file holds tensors of {held} "
                             "layers; the file is corrupt or its metadata was edited")
    expected = expected_shapes(config)
    missing = [name for name in expected if name not in found]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(f"{path} lacks tensors the architecture needs: "
                             f"{', '.join(spell(n) for n in missing[:3])}{more}")
    for name, shape in expected.items():
        file_name, stored = found[name]
        if tuple(stored) != shape:
            raise ModelFileError(f"{path}: tensor {file_name} has shape {list(stored)} but the architecture "
                                 f"(its metadata) needs {list(shape)}; the file is corrupt or not this model")
