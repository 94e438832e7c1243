"""The memory plan of a ServeConfig, checked against memory.max_gpu_memory before anything loads."""
from __future__ import annotations

from dataclasses import dataclass

from engine.memory.budget import (SERVE_KEYS, FitChoice, ModelWeights, check_budget, dummy_formats, fit_to_budget,
                                  model_formats, run_settings)
from engine.memory.plan import MemoryPlan, RunSettings, make_plan
from engine.sources.model_config import ModelConfig
from engine.run.config import ServeConfig


@dataclass
class ServePlan:
    weights: ModelWeights
    settings: RunSettings
    plan: MemoryPlan
    limit: int | None  # memory.max_gpu_memory in bytes
    choices: list[FitChoice]  # settings the plan chose to fit the limit (embedding in host memory, prefill chunk)


def kv_type_of(config: ServeConfig) -> str:
    """The KV cache's element type (model.kv_type, or what kv_cache_quant / kv_cache_bits choose)."""
    return config.model.kv_type_name


def serve_plan(config: ServeConfig, architecture: ModelConfig | None = None) -> ServePlan:
    """The plan of what `engine.run.builder.load_engine` will allocate (reads metadata only), with
    the settings left open (memory.embedding_on_host, runtime.prefill_chunk_size) chosen to fit
    memory.max_gpu_memory. architecture: the ModelConfig of a load_format: dummy model."""
    from engine.sources import store
    from engine.weights.loader import open_model_source
    from engine.run.builder import weight_dtype_for
    m, rt = config.model, config.runtime
    cuda = rt.device.startswith("cuda")
    if m.load_format == "dummy":
        assert architecture is not None, "the command passes the architecture of a dummy model"
        weights = dummy_formats(architecture, m.weight_format, name=m.path)
        wbytes = None
    else:
        source = open_model_source(store.resolve_model(m.path))
        weights = model_formats(source, source.model_config(), m.weight_format,
                                keep_codes=cuda)
        dtype = weight_dtype_for(config)
        wbytes = None if dtype is None else dtype.itemsize
    settings = run_settings(weights.config, rt.device, config.seq_len, slots=rt.max_batch_size,
                            prefill_chunk_size=rt.prefill_chunk_size or 512, kv_type=kv_type_of(config),
                            weight_dtype_bytes=wbytes, weight_offload=config.memory.weight_offload,
                            kv_offload=config.memory.kv_offload, rotation_block=weights.rotation_block,
                            dummy=m.load_format == "dummy",
                            embedding_on_host=bool(config.memory.embedding_on_host))
    limit = config.memory.max_gpu_memory_bytes
    settings, choices = fit_to_budget(weights, settings, limit, embedding_auto=config.memory.embedding_on_host is None,
                                      chunk_auto=rt.prefill_chunk_size is None)
    return ServePlan(weights, settings, make_plan(weights.config, weights.formats, settings), limit, choices)


def check_serve_budget(config: ServeConfig, architecture: ModelConfig | None = None) -> ServePlan:
    """The plan, refused (BonsaiError, one line with what would fit) when over memory.max_gpu_memory."""
    planned = serve_plan(config, architecture)
    check_budget(planned.plan, planned.limit, planned.weights, planned.settings, SERVE_KEYS)
    return planned
