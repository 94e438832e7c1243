"""From run options to a running pipeline: the device list checked, the stages planned (and checked
against max_gpu_memory per device), the workers started. Used by `bonsai generate / bench` and the server.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import BonsaiError
from engine.memory.plan import MemoryPlan, PlanLine, RunSettings, make_plan
from engine.pipeline.devices import check_machine_devices
from engine.pipeline.split import Stage, plan_stages


@dataclass
class PipelinePlan:
    stages: list[Stage]
    plans: list[MemoryPlan]  # what each device holds
    backend: str  # nccl | gloo

    def as_dict(self) -> dict:
        return {"backend": self.backend, "stages": [
            {"device": s.device, "first_layer": s.first, "end_layer": s.end, "layers": s.num_layers,
             "embedding": s.takes_tokens, "output_layer": s.gives_logits, "weight_bytes": s.weight_bytes,
             "kv_bytes": s.kv_bytes, "total_bytes": p.total} for s, p in zip(self.stages, self.plans)]}


def stage_plan(full: MemoryPlan, stage: Stage) -> MemoryPlan:
    """One device's share: its weights and KV rows, and the buffers of a whole decode step, prefill
    chunk and logits (every stage has its own; the plan keeps the whole model's as a bound)."""
    what = stage.label + (", embedding" if stage.takes_tokens else "") + (
        ", norm + output layer" if stage.gives_logits else "")
    lines = [PlanLine("weights", what, stage.weight_bytes),
             PlanLine("kv", f"KV cache of {stage.num_layers} layers", stage.kv_bytes)]
    lines += [line for line in full.lines if line.category not in ("weights", "kv")]
    return MemoryPlan(lines)


def plan_pipeline(config, formats, settings: RunSettings, devices: list[str], backend: str | None = None
                  ) -> PipelinePlan:
    backend = backend or check_machine_devices(devices)
    stages = plan_stages(config, formats, settings, devices)
    full = make_plan(config, formats, settings)
    return PipelinePlan(stages, [stage_plan(full, s) for s in stages], backend)


def check_pipeline_budget(pp: PipelinePlan, limit: int | None, option: str) -> None:
    """Refuse (one line) a stage whose share is over the per-device limit."""
    from engine.memory.budget import format_bytes
    if limit is None:
        return
    for stage, plan in zip(pp.stages, pp.plans):
        if plan.total > limit:
            cats = plan.categories()
            raise BonsaiError(f"{option} {format_bytes(limit)}: pipeline stage {stage.index} on {stage.device} "
                              f"({stage.label}) needs {format_bytes(plan.total)} (weights "
                              f"{format_bytes(cats.get('weights', 0))}, KV {format_bytes(cats.get('kv', 0))}); "
                              "list more devices, or lower the context or slots (see bonsai info --plan)")


def open_pipeline(source, pp: PipelinePlan, max_seq_len: int, num_slots: int = 1, prefill_chunk_size: int = 512,
                  kv_type: str = "bf16", max_gpu_memory: int | None = None, fast_decode: bool | None = None):
    """Start the pipeline (engine.pipeline.runner.start_pipeline) of a checked plan. fast_decode:
    the fused decode step (default: on GPUs)."""
    from engine.pipeline.runner import start_pipeline
    return start_pipeline(source, pp.stages, pp.backend, max_seq_len, num_slots, prefill_chunk_size, kv_type,
                          fast_decode, max_gpu_memory)
