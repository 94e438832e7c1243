"""Names in a pipeline stage's model (pure): its layers numbered locally from 0, the whole model's
(global) names, and which modules and tensors a stage holds. `stage` None means the whole model."""
from __future__ import annotations

from engine.sources.model_config import ModelConfig


def stage_holds(stage, config: ModelConfig, name: str) -> bool:
    """Whether a pipeline stage (engine.pipeline.split.Stage; None: the whole model) holds the module
    or canonical tensor `name` (global layer numbers): its blocks, the embedding on the first stage
    (and, tied, the last: the output layer), the final norm and output layer on the last."""
    if stage is None:
        return True
    part = name.split(".")[0]
    if part == "layers" and name != "layers":
        return stage.first <= int(name.split(".")[1]) < stage.end
    if part in ("embed", "embed_tokens"):
        return stage.takes_tokens or (stage.gives_logits and config.tie_word_embeddings)
    if part in ("norm", "lm_head"):
        return stage.gives_logits
    return True  # the model itself (rotary frequencies), rope_freqs, the block list


def layer_index(name: str) -> int | None:
    """The block number in a module or tensor name (layers.12.attention.wqkv → 12); None outside the blocks."""
    if name.startswith("layers.") and name != "layers":
        return int(name.split(".")[1])
    return None


def global_name(name: str, first_layer: int) -> str:
    """A stage model's module name with its layer number made global (layers.0 of a stage from layer 12
    is layers.12)."""
    if first_layer and name.startswith("layers.") and name != "layers":
        _, index, *rest = name.split(".")
        return ".".join(["layers", str(int(index) + first_layer), *rest])
    return name


def local_name(name: str, first_layer: int) -> str:
    """The inverse of `global_name`: a model-wide name as a stage model's module name."""
    if first_layer and name.startswith("layers.") and name != "layers":
        _, index, *rest = name.split(".")
        return ".".join(["layers", str(int(index) - first_layer), *rest])
    return name
