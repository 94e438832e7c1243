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
from engine.run.config import ServeConfig
from engine.decoding.engine import EngineLoop
from engine.decoding.metrics import Metrics
from engine.decoding.sequence import ThinkingRules

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
        cpu = config.runtime.first_device == "cpu"
        return torch.float32 if cpu and config.runtime.max_batch_size > 1 else None
    return getattr(torch, name)


def offloaded_layers(config: ServeConfig, num_layers: int) -> frozenset[int] | None:
    """The blocks whose weights stay in host memory: with memory.weight_offload, every block (a memory
    plan that places some on the GPU narrows this); None: weight offload is off."""
    return frozenset(range(num_layers)) if config.memory.weight_offload else None


def tokenizer_of(spec: str):
    """The tokenizer of a model (path or pulled name) without loading its weights."""
    from engine.sources import store
    from engine.sources.gguf_file import GGUFFile
    from engine.sources.tokenizer import Tokenizer
    path = store.resolve_model(spec)
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata) if path.is_file() else Tokenizer.from_hf_dir(path)


def load_engine(config: ServeConfig, metrics: Metrics | None = None,
                progress: Callable[[str, float], None] = lambda stage, fraction: None,
                architecture=None) -> Served:
    """architecture: with model.load_format dummy, the ModelConfig read from model.path (the
    command reads that YAML); the weights are generated and model.tokenizer gives the tokenizer.
    The memory plan is checked against memory.max_gpu_memory before anything loads; on a GPU the
    allocator is then capped at the limit (engine.memory.limit)."""
    from engine.memory.limit import check_usage, limit_device_memory, within_limit
    from engine.runtime.runner import ModelRunner
    from engine.run.plan import check_serve_budget

    m, rt = config.model, config.runtime
    if config.memory.pipeline_parallel:
        return _load_pipelined(config, metrics, progress, architecture)
    progress("planning GPU memory", 0.01)
    planned = check_serve_budget(config, architecture)  # refused here, before loading, when over the limit
    budget = planned.limit
    if budget is not None:
        limit_device_memory(budget, rt.device)
    for choice in planned.choices:
        log.info("to fit memory.max_gpu_memory: %s", choice.line)
    with within_limit(budget, "loading the model"):
        loaded, tokenizer, path = _load_model(config, progress, architecture, planned.settings.embedding_on_host)
    check_usage(budget, loaded.device, "loading the model", planned.plan.category("weights"))
    if m.chat_template:
        template = Path(m.chat_template).expanduser()
        if not template.is_file():
            raise BonsaiError(f"config model.chat_template: no file {template}; give a .jinja file")
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    limit = loaded.config.max_position_embeddings
    if config.seq_len > limit:
        raise BonsaiError(f"config runtime.max_seq_len {config.seq_len} exceeds the model's {limit} positions; "
                          f"lower it to {limit} or less")
    stage = "allocating the KV cache" + (" and capturing CUDA graphs" if rt.device != "cpu" else "")
    progress(stage, 0.85)
    with within_limit(budget, stage):
        mem = config.memory
        runner = ModelRunner(loaded, max_seq_len=config.seq_len, num_slots=rt.max_batch_size,
                             prefill_chunk_size=planned.settings.prefill_chunk_size, kv_type=m.kv_type_name,
                             kv_offload=mem.kv_offload,
                             host_kv_bytes=mem.host_kv_mib * 2**20 if mem.host_kv_mib else None,
                             offload_layers=offloaded_layers(config, loaded.config.num_layers),
                             prefill_graphs=planned.limit is None)
        th = config.thinking
        spec = config.spec_config
        if spec is not None:
            progress(f"building each slot's drafter ({spec.method})", 0.9)
        engine = EngineLoop(runner, tokenizer, config.slot_context, config.server.max_queue,
                            ThinkingRules(th.start_tag, th.end_tag, th.end_message), metrics, speculative=spec,
                            prefill_budget=config.server.max_prefill_tokens_per_step)
        if runner.decoder is not None:  # capture the fused step for every row count in use now, not mid-request
            runner.prepare_rows(engine.spec.max_rows() if engine.spec is not None else rt.max_batch_size)
    check_usage(budget, loaded.device, stage, planned.plan.total)
    log.info("serving %s: %d slots of %d tokens on %s (KV cache %s, %.1f MB%s)%s%s", path.name, rt.max_batch_size,
             engine.slot_context, rt.device, runner.cache.kv_type.name, runner.cache.nbytes / 1e6,
             " in host memory" if mem.kv_offload else "",
             " with block weights streamed from host memory" if runner.weight_stream is not None else "",
             f", speculative {spec.method} k={spec.num_draft_tokens} per slot" if spec is not None else "")
    progress("ready", 1.0)
    return Served(engine.start(), m.name or path.stem, config)


def _load_pipelined(config: ServeConfig, metrics: Metrics | None, progress: Callable[[str, float], None],
                    architecture) -> Served:
    """load_engine over several devices (memory.pipeline_parallel): the devices and each one's share
    of the plan are checked before anything loads; rank 0 (this process) runs stage 0 and the engine."""
    from engine.sources import store
    from engine.pipeline.launch import ModelSource
    from engine.pipeline.setup import check_pipeline_budget, open_pipeline, plan_pipeline
    from engine.run.plan import serve_plan

    m, rt = config.model, config.runtime
    progress("planning the pipeline stages", 0.01)
    planned = serve_plan(config, architecture)
    pp = plan_pipeline(planned.weights.config, planned.weights.formats, planned.settings, rt.devices)
    check_pipeline_budget(pp, planned.limit, "config memory.max_gpu_memory")
    limit = planned.weights.config.max_position_embeddings
    if config.seq_len > limit:
        raise BonsaiError(f"config runtime.max_seq_len {config.seq_len} exceeds the model's {limit} positions; "
                          f"lower it to {limit} or less")
    fmt = m.weight_format
    if m.load_format == "dummy":
        path = Path(m.path)
        source = ModelSource(architecture=architecture, name=path.stem, weight_format=fmt)
        tokenizer = tokenizer_of(m.tokenizer)
    else:
        path = store.resolve_model(m.path)
        source = ModelSource(path=str(path), weight_dtype=weight_dtype_for(config), weight_format=fmt)
        tokenizer = None
    split = ", ".join(f"{s.device}: {s.label}" for s in pp.stages)
    progress(f"loading {path.name} in {len(pp.stages)} pipeline stages ({split})", 0.05)
    runner = open_pipeline(source, pp, config.seq_len, rt.max_batch_size, rt.prefill_chunk_size, m.kv_type_name,
                           planned.limit)
    try:
        tokenizer = tokenizer or runner.loaded.require_tokenizer()
        if m.load_format == "dummy" and tokenizer.vocab_size > architecture.vocab_size:
            raise BonsaiError(f"config model.tokenizer: its {tokenizer.vocab_size} tokens do not fit the "
                              f"{architecture.vocab_size}-token vocabulary of {path.name}; use a smaller tokenizer")
        if m.chat_template:
            template = Path(m.chat_template).expanduser()
            if not template.is_file():
                raise BonsaiError(f"config model.chat_template: no file {template}; give a .jinja file")
            tokenizer.chat_template = template.read_text(encoding="utf-8")
        th, spec = config.thinking, config.spec_config
        progress("capturing the decode steps" if runner.decoder is not None else "starting the engine", 0.9)
        engine = EngineLoop(runner, tokenizer, config.slot_context, config.server.max_queue,
                            ThinkingRules(th.start_tag, th.end_tag, th.end_message), metrics, speculative=spec,
                            prefill_budget=config.server.max_prefill_tokens_per_step)
        runner.prepare_rows(engine.spec.max_rows() if engine.spec is not None else rt.max_batch_size)
    except BaseException:
        runner.close()
        raise
    log.info("serving %s: %d slots of %d tokens, pipelined over %s%s", path.name, rt.max_batch_size,
             engine.slot_context, split,
             f", speculative {spec.method} k={spec.num_draft_tokens} per slot" if spec is not None else "")
    progress("ready", 1.0)
    return Served(engine.start(), m.name or path.stem, config)


def _load_model(config: ServeConfig, progress: Callable[[str, float], None], architecture,
                embedding_on_host: bool = False):
    """(LoadedModel, tokenizer, path) of the config's model: generated (dummy) or read."""
    from engine.sources import store
    from engine.weights.loader import load_dummy, load_model

    m, rt = config.model, config.runtime
    fmt = m.weight_format
    if m.load_format == "dummy":
        assert architecture is not None, "the command passes the architecture of a dummy model"
        path = Path(m.path)
        progress(f"generating {path.stem} ({m.quant_type}) on {rt.device}", 0.05)
        loaded = load_dummy(architecture, path.stem, device=rt.device, weight_format=fmt,
                            embedding_on_host=embedding_on_host)
        tokenizer = tokenizer_of(m.tokenizer)
        if tokenizer.vocab_size > architecture.vocab_size:
            raise BonsaiError(f"config model.tokenizer: its {tokenizer.vocab_size} tokens do not fit the "
                              f"{architecture.vocab_size}-token vocabulary of {path.name}; use a smaller tokenizer")
        return loaded, tokenizer, path
    progress("finding the model", 0.02)
    path = store.resolve_model(m.path)
    progress(f"loading {path.name} on {rt.device}", 0.05)
    loaded = load_model(path, device=rt.device, weight_dtype=weight_dtype_for(config), weight_format=fmt,
                        embedding_on_host=embedding_on_host)
    return loaded, loaded.require_tokenizer(), path
