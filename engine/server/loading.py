"""From a ServeConfig to a running engine: model, tokenizer, runner with its slots, engine loop.

`bonsai serve` runs this in a background thread (GET /health reports the stage meanwhile);
`bonsai chat --config` runs it directly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import BonsaiError
from engine.server.config import ServeConfig
from engine.server.engine_loop import EngineLoop
from engine.server.metrics import Metrics
from engine.server.sequence import ThinkingRules

log = logging.getLogger(__name__)


@dataclass
class Served:
    engine: EngineLoop
    model_id: str
    config: ServeConfig


def weight_dtype_for(config: ServeConfig):
    """runtime.weight_dtype as a torch dtype (None: the loader's default). On the CPU, auto picks
    float32 when several slots decode together: a batched float16 matmul widens the whole weight
    each step, float32 reads it once for every row."""
    import torch
    name = config.runtime.weight_dtype
    if name == "auto":
        return torch.float32 if config.runtime.device == "cpu" and config.runtime.max_batch_size > 1 else None
    return getattr(torch, name)


def offloaded_layers(config: ServeConfig, num_layers: int) -> frozenset[int] | None:
    """The blocks whose weights stay in host memory: with memory.weight_offload, every block (a memory
    plan that places some on the GPU narrows this); None: weight offload is off."""
    return frozenset(range(num_layers)) if config.memory.weight_offload else None


def tokenizer_of(spec: str):
    """The tokenizer of a model (path or pulled name) without loading its weights."""
    from engine import store
    from engine.gguf_file import GGUFFile
    from engine.tokenizer import Tokenizer
    path = store.resolve_model(spec)
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata) if path.is_file() else Tokenizer.from_hf_dir(path)


def load_engine(config: ServeConfig, metrics: Metrics | None = None,
                progress: Callable[[str, float], None] = lambda stage, fraction: None,
                architecture=None) -> Served:
    """architecture: with model.load_format dummy, the ModelConfig read from model.path (the
    command reads that YAML); the weights are generated and model.tokenizer gives the tokenizer."""
    from engine import store
    from engine.loader import load_dummy, load_model
    from engine.packed_linear import WeightFormat
    from engine.runner import ModelRunner

    m, rt = config.model, config.runtime
    fmt = WeightFormat(quant_type=m.quant_type, group_size=m.group_size)
    if m.load_format == "dummy":
        assert architecture is not None, "the command passes the architecture of a dummy model"
        path = Path(m.path)
        progress(f"generating {path.stem} ({m.quant_type}) on {rt.device}", 0.05)
        loaded = load_dummy(architecture, path.stem, device=rt.device, weight_format=fmt)
        tokenizer = tokenizer_of(m.tokenizer)
        if tokenizer.vocab_size > architecture.vocab_size:
            raise BonsaiError(f"config model.tokenizer: its {tokenizer.vocab_size} tokens do not fit the "
                              f"{architecture.vocab_size}-token vocabulary of {path.name}; use a smaller tokenizer")
    else:
        progress("finding the model", 0.02)
        path = store.resolve_model(m.path)
        progress(f"loading {path.name} on {rt.device}", 0.05)
        loaded = load_model(path, device=rt.device, weight_dtype=weight_dtype_for(config), weight_format=fmt)
        tokenizer = loaded.require_tokenizer()
    if m.chat_template:
        template = Path(m.chat_template).expanduser()
        if not template.is_file():
            raise BonsaiError(f"config model.chat_template: no file {template}; give a .jinja file")
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    limit = loaded.config.max_position_embeddings
    if config.seq_len > limit:
        raise BonsaiError(f"config runtime.max_seq_len {config.seq_len} exceeds the model's {limit} positions; "
                          f"lower it to {limit} or less")
    progress("allocating the KV cache" + (" and capturing CUDA graphs" if rt.device != "cpu" else ""), 0.85)
    mem = config.memory
    runner = ModelRunner(loaded, max_seq_len=config.seq_len, num_slots=rt.max_batch_size,
                         prefill_chunk_size=rt.prefill_chunk_size, kv_offload=mem.kv_offload,
                         host_kv_bytes=mem.host_kv_mib * 2**20 if mem.host_kv_mib else None,
                         offload_layers=offloaded_layers(config, loaded.config.num_layers))
    if runner.decoder is not None:  # capture the batched step for every row count now, not mid-request
        from engine.runner import MAX_STEP_ROWS
        for rows in range(2, min(rt.max_batch_size, MAX_STEP_ROWS) + 1):
            runner.step_rows([0] * rows, [0] * rows, [0] * rows)  # writes position 0 of slot 0: still empty
    th = config.thinking
    engine = EngineLoop(runner, tokenizer, config.slot_context, config.server.max_queue,
                        ThinkingRules(th.start_tag, th.end_tag, th.end_message), metrics)
    log.info("serving %s: %d slots of %d tokens on %s (KV cache %.1f MB%s)%s", path.name, rt.max_batch_size,
             engine.slot_context, rt.device, runner.cache.nbytes / 1e6, " in host memory" if mem.kv_offload else "",
             " with block weights streamed from host memory" if runner.weight_stream is not None else "")
    progress("ready", 1.0)
    return Served(engine.start(), m.name or path.stem, config)
