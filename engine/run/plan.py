"""The memory plan of a run config, from the model's metadata alone, before anything loads.

The settings the config leaves open (memory.embedding_on_host, runtime.prefill_chunk_size) are
chosen here to fit memory.max_gpu_memory (engine.memory.budget.fit_to_budget); the plan counts the
fused step at every row count the run captures (one per slot, k + 1 per slot with speculation) and
the drafters' own weights and caches. engine.run.builder.open_run refuses a plan over the limit.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from engine.memory.budget import (FitChoice, ModelWeights, drafter_plan, dummy_formats, fit_to_budget,
                                  host_embedding_possible, model_formats, run_settings)
from engine.memory.plan import MemoryPlan, RunSettings, make_plan
from engine.memory.stream_fit import stream_plan
from engine.memory.streaming import StreamPlan, streamed_blocks
from engine.run.config import RunConfig
from engine.runtime.decode_step import MAX_STEP_ROWS
from engine.sources import store
from engine.sources.model_config import ModelConfig
from engine.weights.formats import WeightFormat
from engine.weights.loader import open_model_source


@dataclass
class RunPlan:
    weights: ModelWeights
    settings: RunSettings
    plan: MemoryPlan
    limit: int | None  # memory.max_gpu_memory in bytes
    choices: list[FitChoice]  # settings the plan chose to fit the limit (embedding in host memory, prefill chunk,
    # the blocks streamed with memory.weight_offload: auto: settings.resident_layers)
    drafter: MemoryPlan | None  # what the drafters add (in `plan` already)
    slot_context: int  # positions one conversation may use
    weight_format: WeightFormat  # model.weight_format with the ternary layout decided: what the loader makes

    @property
    def stream(self) -> StreamPlan | None:
        """With weight offload: which blocks stream and the decode speed that predicts (bonsai info --plan)."""
        if not self.settings.weight_offload:
            return None
        return stream_plan(self.weights.config, self.weights.formats, self.settings)


def model_path(config: RunConfig, auto_pull: bool = False) -> Path:
    """model.path resolved (a file or directory, or a pulled name; auto_pull: pull it if missing)."""
    return store.resolve_model(config.model.path, auto_pull=auto_pull)


def plan_run(config: RunConfig, architecture: ModelConfig | None = None, auto_pull: bool = False) -> RunPlan:
    """The plan of what open_run will allocate on the first device (a pipeline: its split comes from
    it, engine.pipeline.setup). architecture: the ModelConfig of a load_format: dummy model.
    model.ternary_layout auto: the 2-bit layout (faster kernels), unless its weights do not fit
    memory.max_gpu_memory resident (over the limit, or blocks streamed): then base-3 (17.6% fewer
    bytes per ternary matrix: more blocks resident and fewer bytes over PCIe per token)."""
    m = config.model
    source = None if m.load_format == "dummy" else open_model_source(model_path(config, auto_pull))
    fmt = m.weight_format
    if fmt.ternary_layout != "auto":
        return _plan(config, architecture, source, fmt)
    planned = _plan(config, architecture, source, replace(fmt, ternary_layout="2bit"))
    if not _ternary(planned) or (planned.limit is None and config.memory.weight_offload is not True):
        return planned
    streamed = streamed_blocks(planned.weights.config.num_layers, planned.settings.weight_offload,
                               planned.settings.resident_layers)
    if not streamed and (planned.limit is None or planned.plan.total <= planned.limit):
        return planned
    base3 = _plan(config, architecture, source, replace(fmt, ternary_layout="base3"))
    if _ternary(base3, "tri5"):
        base3.choices.insert(0, FitChoice("ternary_layout", "base3", "ternary matrices in the base-3 layout, 17.6% "
                                          "fewer bytes than the 2-bit one, whose weights do not fit resident "
                                          "(model.ternary_layout: 2bit keeps it)"))
    return base3


def _ternary(planned: RunPlan, kind: str = "tri") -> bool:
    return any(f.kind == kind for f in planned.weights.formats.values())


def _plan(config: RunConfig, architecture: ModelConfig | None, source, fmt: WeightFormat) -> RunPlan:
    m, rt, mem = config.model, config.runtime, config.memory
    cuda = rt.first_device.startswith("cuda")
    if source is None:
        assert architecture is not None, "the command passes the architecture of a dummy model"
        weights = dummy_formats(architecture, fmt, name=m.path)
        weight_bytes = None
    else:
        weights = model_formats(source, source.model_config(), fmt, keep_codes=cuda)
        dtype = config.weight_dtype
        weight_bytes = None if dtype is None else dtype.itemsize
    slot_context, seq_len = config.contexts(weights.config.max_position_embeddings)
    spec = config.spec_config
    rows = rt.max_batch_size * (spec.num_draft_tokens + 1 if spec is not None else 1)
    if mem.max_gpu_memory_bytes is None and mem.weight_offload is not True:  # short prompts run through the 16-row step
        rows = MAX_STEP_ROWS  # (engine.runtime.runner.SHORT_PREFILL_TOKENS), captured with the others
    settings = run_settings(weights.config, rt.first_device, seq_len, slots=rt.max_batch_size,
                            prefill_chunk_size=rt.prefill_chunk_size or 512, kv_type=m.kv_type_name,
                            graph_rows=min(rows, MAX_STEP_ROWS) if cuda and not mem.kv_offload else 0,
                            weight_dtype_bytes=weight_bytes, weight_offload=mem.weight_offload is True,
                            kv_offload=mem.kv_offload, rotation_block=weights.rotation_block,
                            dummy=m.load_format == "dummy",
                            # streaming every block: the table is loaded in host memory (the streamer keeps it there)
                            embedding_on_host=bool(mem.embedding_on_host)
                            or (mem.weight_offload is True and host_embedding_possible(weights)),
                            verify_positions=spec.num_draft_tokens + 2 if spec is not None else 0,
                            limited=mem.max_gpu_memory_bytes is not None)
    drafter = drafter_plan(spec, settings, weights.config) if spec is not None else None
    limit = mem.max_gpu_memory_bytes
    settings, choices = fit_to_budget(weights, settings, limit, embedding_auto=mem.embedding_on_host is None,
                                      chunk_auto=rt.prefill_chunk_size is None, drafter=drafter,
                                      stream_auto=mem.weight_offload == "auto")
    plan = make_plan(weights.config, weights.formats, settings, drafter)
    return RunPlan(weights, settings, plan, limit, choices, drafter, slot_context, fmt)
