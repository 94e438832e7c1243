"""Which layers each pipeline stage holds: contiguous ranges balanced by planned bytes (pure).

Stage 0 also holds the embedding (it turns token ids into hidden states), the last stage the final
norm and the output layer (a tied output layer is the embedding matrix: the last stage holds a copy).
Each stage's KV cache holds its own layers, so a layer's bytes are its weights plus its KV rows (a hybrid's
DeltaNet layer: its states instead).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import BonsaiError


@dataclass(frozen=True)
class Stage:
    index: int
    num_stages: int
    device: str
    first: int  # global index of its first layer
    end: int  # one past its last layer
    weight_bytes: int = 0  # planned: its layers' weights, plus the embedding (first) / norm + output layer (last)
    kv_bytes: int = 0  # planned: the KV rows of its layers

    @property
    def num_layers(self) -> int:
        return self.end - self.first

    @property
    def takes_tokens(self) -> bool:
        """Input: token ids through the embedding (stage 0), else the previous stage's hidden states."""
        return self.index == 0

    @property
    def gives_logits(self) -> bool:
        """Output: logits (final norm + output layer, the last stage), else hidden states for the next."""
        return self.index == self.num_stages - 1

    @property
    def rank(self) -> int:
        return self.index

    @property
    def label(self) -> str:
        return f"layers {self.first}-{self.end - 1}" if self.num_layers > 1 else f"layer {self.first}"


def split_layers(layer_bytes: list[int], first_extra: int, last_extra: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous (first, end) layer ranges, one per stage, none empty, that minimize the largest
    stage total (its layers' bytes, plus first_extra on stage 0 and last_extra on the last stage).
    Among equally good splits, later stages take as many layers as they can (rank 0 also runs the
    driver: tokenizer, sampling, scheduler, drafters)."""
    n = len(layer_bytes)
    if num_stages < 1 or num_stages > n:
        raise BonsaiError(f"cannot split {n} layers into {num_stages} pipeline stages: list at most {n} devices")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(s: int, i: int, j: int) -> int:  # stage s holds layers i..j-1
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0) + (last_extra if s == num_stages - 1 else 0)

    inf = float("inf")
    # best[s][j]: the smallest largest-stage total of layers 0..j-1 in stages 0..s
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            best[s][j] = min(max(best[s - 1][i], cost(s, i, j)) for i in range(s, j))
    target = best[num_stages - 1][n]
    ranges: list[tuple[int, int]] = []
    end = n
    for s in range(num_stages - 1, 0, -1):  # from the last stage back: each takes as many layers as it can
        first = next(i for i in range(s, end) if cost(s, i, end) <= target and best[s - 1][i] <= target)
        ranges.append((first, end))
        end = first
    ranges.append((0, end))
    return ranges[::-1]


def stage_config(config, first: int, end: int):
    """The ModelConfig of the layers first..end-1 alone (a stage's KV cache and DeltaNet states hold those)."""
    import dataclasses
    hybrid = config.hybrid
    if hybrid is not None:
        hybrid = dataclasses.replace(hybrid, layer_types=hybrid.layer_types[first:end])
    return dataclasses.replace(config, num_layers=end - first, hybrid=hybrid)


def layer_cache_bytes(config, settings) -> list[int]:
    """Per layer, what its slots hold on the device: KV rows (an attention layer), or a hybrid's DeltaNet state
    and the states its verify passes keep (a linear-attention layer), as engine.memory.plan counts them."""
    from quant.kv_format import KV_TYPES, kv_bytes_per_token
    kv_layer = kv_bytes_per_token(KV_TYPES[settings.kv_type], 1, config.num_kv_heads, config.head_dim,
                                  settings.dtype_bytes) * settings.max_seq_len * settings.slots
    if config.hybrid is None:
        return [kv_layer] * config.num_layers
    hc = config.hybrid
    state = hc.state_bytes_per_slot(settings.dtype_bytes) // hc.counts()["linear_attention"]  # one layer's
    linear = state * settings.slots * (1 + settings.verify_positions)
    return [linear if config.is_linear(i) else kv_layer for i in range(config.num_layers)]


def plan_stages(config, formats, settings, devices: list[str]) -> list[Stage]:
    """The stages of a model on `devices` (one stage each, in order) from its memory plan's weights
    (engine.memory.plan.weight_tensors) and cache bytes per layer (layer_cache_bytes)."""
    from engine.memory.plan import weight_tensors
    cache = layer_cache_bytes(config, settings)
    layer_weights = [0] * config.num_layers
    extras: dict[str, int] = {}
    for what, layer, size in weight_tensors(config, formats, settings):
        if layer is None:
            extras[what] = extras.get(what, 0) + size
        else:
            layer_weights[layer] += size
    first_extra = extras["embed"] + extras["inv_freq"]
    # the output layer: its own matrix, or (tied, not packed) the embedding's copy on the last stage
    last_extra = extras["norm"] + extras["inv_freq"] + extras.get("lm_head", extras["embed"])
    ranges = split_layers([w + c for w, c in zip(layer_weights, cache)], first_extra, last_extra, len(devices))
    stages = []
    for s, ((first, end), device) in enumerate(zip(ranges, devices)):
        weights = sum(layer_weights[first:end]) + (first_extra if s == 0 else 0)
        weights += last_extra if s == len(devices) - 1 else 0
        stages.append(Stage(s, len(devices), device, first, end, weights, sum(cache[first:end])))
    return stages
