"""From a run config to a running model: plan → cap → load → runner → check, on one device or a pipeline.

`open_run` is the one way every command builds a run (generate, chat, bench and the server;
`bonsai info --plan` stops after the plan): the memory plan is made from metadata and refused over
memory.max_gpu_memory before anything loads, the CUDA allocator is capped at the limit, the model
is loaded in its run-time weight formats, the runner allocates the KV cache of every slot (and
captures the fused step), and the allocator's usage is checked after each stage. With several
devices (memory.pipeline_parallel) the plan is split into stages, each checked against the limit,
and the workers are started; this process runs stage 0.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.decoding.engine import Engine
from engine.errors import BonsaiError
from engine.decoding.metrics import Metrics
from engine.decoding.sequence import ThinkingRules
from engine.memory.budget import SERVE_KEYS, check_budget
from engine.memory.limit import check_usage, limit_device_memory, within_limit
from engine.memory.plan import RunSettings
from engine.memory.streaming import streamed_blocks
from engine.pipeline.devices import check_machine_devices
from engine.pipeline.launch import ModelSource
from engine.pipeline.setup import PipelinePlan, check_pipeline_budget, open_pipeline, plan_pipeline
from engine.run.config import RunConfig
from engine.run.plan import RunPlan, model_path, plan_run
from engine.run.preflight import chat_template, check_context, check_dummy_tokenizer
from engine.runtime.runner import ModelRunner, Runner
from engine.sources import store
from engine.sources.gguf_file import GGUFFile
from engine.sources.model_config import ModelConfig
from engine.sources.tokenizer import Tokenizer
from engine.speculative.config import build_drafters
from engine.weights.formats import WeightFormat
from engine.weights.loader import LoadedModel, load_dummy, load_model
from engine.weights.packed_linear import set_unpack_slice

log = logging.getLogger(__name__)
Progress = Callable[[str, float], None]  # (stage, fraction done): the server's /health, the CLI's spinner


@dataclass
class Run:
    """A loaded model with its runner (ModelRunner, or a PipelineRunner driving the stages)."""
    config: RunConfig
    loaded: LoadedModel  # with a pipeline: stage 0's part (its config is the whole model's)
    tokenizer: Tokenizer | None  # None: generated weights without model.tokenizer (token ids only)
    runner: Runner
    plan: RunPlan  # of the first device
    pipeline: PipelinePlan | None = None
    name: str = ""  # model.name, else the model file's or directory's name

    def require_tokenizer(self) -> Tokenizer:
        """The run's tokenizer (a generated model's: model.tokenizer's), or the one-line refusal of text."""
        return self.tokenizer if self.tokenizer is not None else self.loaded.require_tokenizer()

    @property
    def slot_context(self) -> int:
        """Positions one conversation may use."""
        return min(self.plan.slot_context, self.runner.max_seq_len)

    def engine(self, metrics: Metrics | None = None, max_queue: int = 16, prefill_budget: int | None = None,
               speculative: bool = True, mixed_prefill: bool = True) -> Engine:
        """The decoding engine over this run's slots: the config's thinking rules and, with speculation
        (unless `speculative` is off), one drafter per slot, and with adaptive speculation on any device the
        gate that keeps decoding plain where speculating is measured slower (engine.decoding.spec_gate: on a CPU
        whose plain steps are fast, a draft model can cost more than it saves); the fused step is captured now
        for every row count the engine will ask for."""
        spec = self.config.spec_config if speculative else None
        th = self.config.thinking
        with within_limit(self.plan.limit, "building the drafters"):
            drafters = (build_drafters(spec, self.loaded, self.runner.max_seq_len, len(self.runner.cache.slots))
                        if spec is not None else None)
            engine = Engine(self.runner, self.tokenizer, self.slot_context, max_queue,
                            ThinkingRules(th.start_tag, th.end_tag, th.end_message), metrics, drafters,
                            spec.num_draft_tokens if spec is not None else 4, prefill_budget,
                            spec.method if spec is not None else None, mixed_prefill=mixed_prefill,
                            spec_gate=spec.adaptive if spec is not None else None)
            self.runner.prepare_rows(engine.spec.max_rows() if engine.spec is not None
                                     else self.config.runtime.max_batch_size)
            self.runner.warm_up()
        check_usage(self.plan.limit, self.loaded.device, "building the engine", self.plan.plan.total)
        return engine

    def close(self) -> None:
        """End the pipeline's workers (a no-op on one device); idempotent."""
        self.runner.close()


def tokenizer_of(spec: str) -> Tokenizer:
    """The tokenizer of a model (path or pulled name) without loading its weights."""
    path = store.resolve_model(spec)
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata) if path.is_file() else Tokenizer.from_hf_dir(path)


def offloaded_layers(settings: RunSettings, num_layers: int) -> frozenset[int] | None:
    """The blocks whose weights stay in host memory and stream in each pass, as the memory plan chose
    them (memory.weight_offload true: every block; auto: those max_gpu_memory cannot hold); None: none."""
    streamed = streamed_blocks(num_layers, settings.weight_offload, settings.resident_layers)
    return frozenset(streamed) if streamed else None


def load_run_model(config: RunConfig, architecture: ModelConfig | None = None, embedding_on_host: bool = False,
                   auto_pull: bool = False, progress: Progress = lambda stage, fraction: None,
                   host_layers: frozenset[int] = frozenset(), weight_format: WeightFormat | None = None
                   ) -> tuple[LoadedModel, Tokenizer | None]:
    """The config's model on its device, in its run-time formats (weight_format: as the plan decided
    them, default model.weight_format), and its tokenizer (a dummy model's from model.tokenizer, checked
    to fit its vocabulary); host_layers: blocks made in host memory (the streamed ones: never on the
    device). For a run, use open_run."""
    m, device = config.model, config.runtime.first_device
    fmt = weight_format or m.weight_format
    if m.load_format == "dummy":
        assert architecture is not None, "the command passes the architecture of a dummy model"
        name = Path(m.path).stem
        progress(f"generating {name} ({m.quant_type}) on {device}", 0.05)
        loaded = load_dummy(architecture, name, device=device, weight_format=fmt,
                            embedding_on_host=embedding_on_host, host_layers=host_layers)
        return loaded, _dummy_tokenizer(config, architecture)
    path = model_path(config, auto_pull)
    progress(f"loading {path.name} on {device}", 0.05)
    loaded = load_model(path, device=device, weight_dtype=config.weight_dtype, weight_format=fmt,
                        embedding_on_host=embedding_on_host, host_layers=host_layers, cpu_int4=config.cpu_int4,
                        narrow_head=config.narrow_head, cpu_kernels=config.runtime.cpu_kernels)
    return loaded, _with_template(config, loaded.tokenizer)


def open_run(config: RunConfig, architecture: ModelConfig | None = None, auto_pull: bool = False,
             progress: Progress = lambda stage, fraction: None, keys: dict[str, str | None] = SERVE_KEYS,
             option: str = "config memory.max_gpu_memory") -> Run:
    """The run of `config` (see the module doc). architecture: with model.load_format dummy, the
    ModelConfig read from model.path (the command reads that YAML). keys / option: how the user
    wrote each setting, for the refusal of a plan over the limit (flags or config keys)."""
    backend = check_machine_devices(config.runtime.devices) if config.memory.pipeline_parallel else None
    progress("planning GPU memory", 0.01)
    planned = plan_run(config, architecture, auto_pull)
    check_context(config, planned.weights.config)
    if config.memory.pipeline_parallel:
        return _open_pipeline(config, planned, architecture, progress, option, backend)
    check_budget(planned.plan, planned.limit, planned.weights, planned.settings, keys, option, planned.drafter)
    rt, limit = config.runtime, planned.limit
    if limit is not None:
        limit_device_memory(limit, rt.device)
    for choice in planned.choices:
        log.info("to fit memory.max_gpu_memory: %s", choice.line)
    num_layers = planned.weights.config.num_layers
    streamed = offloaded_layers(planned.settings, num_layers)
    with within_limit(limit, "loading the model"):
        loaded, tokenizer = load_run_model(config, architecture, planned.settings.embedding_on_host, auto_pull,
                                           progress, streamed or frozenset(), planned.weight_format)
    check_usage(limit, loaded.device, "loading the model", planned.plan.category("weights"))
    set_unpack_slice(loaded.model, planned.settings.unpack_slice_bytes)  # as the plan counted prefill
    stage = "allocating the KV cache" + (" and capturing CUDA graphs" if loaded.device.type == "cuda" else "")
    progress(stage, 0.85)
    mem = config.memory
    with within_limit(limit, stage):
        runner = ModelRunner(loaded, max_seq_len=planned.settings.max_seq_len, num_slots=rt.max_batch_size,
                             prefill_chunk_size=planned.settings.prefill_chunk_size, kv_type=config.model.kv_type_name,
                             kv_offload=mem.kv_offload, host_kv_bytes=mem.host_kv_mib * 2**20 if mem.host_kv_mib else None,
                             offload_layers=streamed,
                             prefill_graphs=limit is None)
    check_usage(limit, loaded.device, stage, planned.plan.total)
    return Run(config, loaded, tokenizer, runner, planned, name=_name(config, loaded))


def _open_pipeline(config: RunConfig, planned: RunPlan, architecture, progress: Progress, option: str,
                   backend: str) -> Run:
    """open_run over several devices: the devices and each one's share of the plan are checked before
    anything loads; this process (rank 0) runs stage 0."""
    m, rt = config.model, config.runtime
    progress("planning the pipeline stages", 0.02)
    pp = plan_pipeline(planned.weights.config, planned.weights.formats, planned.settings, rt.devices, backend)
    check_pipeline_budget(pp, planned.limit, option)
    if m.load_format == "dummy":
        source = ModelSource(architecture=architecture, name=Path(m.path).stem, weight_format=planned.weight_format,
                             unpack_slice_bytes=planned.settings.unpack_slice_bytes)
    else:
        source = ModelSource(path=str(model_path(config)), weight_dtype=config.weight_dtype,
                             weight_format=planned.weight_format, cpu_int4=config.cpu_int4,
                             cpu_kernels=config.runtime.cpu_kernels, narrow_head=config.narrow_head, unpack_slice_bytes=planned.settings.unpack_slice_bytes)
    split = ", ".join(f"{s.device}: {s.label}" for s in pp.stages)
    progress(f"loading {Path(m.path).name} in {len(pp.stages)} pipeline stages ({split})", 0.05)
    runner = open_pipeline(source, pp, planned.settings.max_seq_len, rt.max_batch_size,
                           planned.settings.prefill_chunk_size, m.kv_type_name, planned.limit)
    try:
        loaded = runner.loaded
        tokenizer = (_dummy_tokenizer(config, architecture) if m.load_format == "dummy"
                     else _with_template(config, loaded.tokenizer))
    except BaseException:
        runner.close()
        raise
    return Run(config, loaded, tokenizer, runner, planned, pp, _name(config, loaded))


def _dummy_tokenizer(config: RunConfig, architecture: ModelConfig) -> Tokenizer | None:
    if not config.model.tokenizer:
        return None
    tokenizer = tokenizer_of(config.model.tokenizer)
    check_dummy_tokenizer(config, architecture, tokenizer)
    return _with_template(config, tokenizer)


def _with_template(config: RunConfig, tokenizer: Tokenizer | None) -> Tokenizer | None:
    """model.chat_template (a .jinja file) in place of the model's own template."""
    if tokenizer is not None:
        tokenizer.chat_template = chat_template(config) or tokenizer.chat_template
    return tokenizer


def _name(config: RunConfig, loaded: LoadedModel) -> str:
    return config.model.name or (Path(config.model.path).stem if config.model.load_format == "dummy"
                                 else loaded.path.stem)
