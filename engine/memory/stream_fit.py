"""The memory plan's choice of streamed blocks (memory.weight_offload: auto) and what a run's streaming
predicts (engine.memory.streaming has the pure arithmetic; this module feeds it a model's plan)."""
from __future__ import annotations

import dataclasses

from engine.memory.plan import MemoryPlan, RunSettings, block_slack, make_plan, weight_tensors
from engine.memory.streaming import StreamPlan, choose_streamed, ring_bytes, streamed_blocks
from engine.sources.model_config import ModelConfig
from engine.weights.formats import LinearFormat


def layer_weight_bytes(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings) -> list[int]:
    """Bytes of each block's weights as loaded (what streaming it moves over PCIe every pass)."""
    out = [0] * config.num_layers
    for _, layer, size in weight_tensors(config, formats, s):
        if layer is not None:
            out[layer] += size
    return out


def stream_plan(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings) -> StreamPlan:
    """The settings' split of the blocks and its predicted decode speed: streamed bytes over PCIe,
    resident ones (blocks on the GPU and the output layer: the embedding gives one row a token) over HBM."""
    per_layer = layer_weight_bytes(config, formats, s)
    streamed = streamed_blocks(config.num_layers, s.weight_offload, s.resident_layers)
    held = set(streamed)
    head = sum(size for what, layer, size in weight_tensors(config, formats, s)
               if what == "lm_head" or (what == "embed" and "lm_head" not in formats and config.tie_word_embeddings))
    resident = sum(b for i, b in enumerate(per_layer) if i not in held) + head
    return StreamPlan(config.num_layers, streamed, sum(per_layer[i] for i in streamed), resident)


def stream_to_fit(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings, limit: int,
                  drafter: MemoryPlan | None = None, embedding_possible: bool = True) -> RunSettings | None:
    """`s` with weight offload of the fewest blocks (spread over the depth) that brings the plan under
    `limit`: everything the plan counts besides the blocks (KV, activations, buffers, the staging
    ring) stays as `s` has it, the embedding table goes to host memory when it may. None when even
    streaming every block does not fit."""
    every = dataclasses.replace(s, weight_offload=True, resident_layers=(),
                                embedding_on_host=s.embedding_on_host or embedding_possible)
    total = make_plan(config, formats, every, drafter).total
    if total > limit:
        return None
    per_layer = layer_weight_bytes(config, formats, every)
    fixed = total - ring_bytes(per_layer, tuple(range(config.num_layers)))  # the plan without any block
    # a resident block costs its bytes and, on CUDA, the allocator's rounding of its tensors (plan.block_slack)
    slack = block_slack(config, formats, every) if s.cuda else [0] * config.num_layers
    streamed = choose_streamed(per_layer, limit - fixed, slack)
    assert streamed is not None, "every block streamed fits, so some choice does"
    held = set(streamed)
    chosen = dataclasses.replace(every, weight_offload=bool(streamed),
                                 resident_layers=tuple(i for i in range(config.num_layers) if i not in held)
                                 if streamed else ())
    return chosen if make_plan(config, formats, chosen, drafter).total <= limit else every
