"""--max-gpu-memory for `bonsai generate` and `bonsai bench`: plan before loading, cap the allocator."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

MAX_GPU_MEMORY_HELP = ("hard GPU memory limit, e.g. 6GB or 5.5GiB: the memory plan is checked before loading "
                       "(refused with what would fit; the embedding table goes to host memory and the prefill chunk "
                       "shrinks when that makes it fit) and the CUDA allocator is capped at it (no cap on the CPU)")
EMBEDDING_ON_HOST_HELP = ("keep the embedding table in host memory (each step copies its tokens' rows to the GPU; the "
                          "decode step stays CUDA-graphed). Default: only when --max-gpu-memory needs it")


@dataclass
class Budget:
    limit: int | None  # bytes, None: no limit
    plan: Any  # engine.memory.plan.MemoryPlan
    settings: Any  # engine.memory.plan.RunSettings
    choices: list = field(default_factory=list)  # engine.memory.budget.FitChoice: what the plan chose to fit


def plan_cli_run(model: Optional[str], device: str, max_seq_len: int, limit_text: Optional[str],
                 load_format: str = "auto", weights: str = "bf16", group_size: int = 128, head_weights: str = "bf16",
                 weight_dtype: str = "auto", spec_config: Any = None, auto_pull: bool = False,
                 kv_type: str = "bf16", kv_offload: bool = False, embedding_on_host: Optional[bool] = None,
                 prefill_chunk_size: int = 512) -> Budget:
    """The memory plan of a one-slot run of MODEL; with a limit, make the choices that fit it
    (embedding_on_host None: the table goes to host memory only if needed; a smaller prefill chunk),
    refuse a plan still over it (one line with what would fit) and cap the CUDA allocator at it.
    Reads metadata only."""
    from bonsai_cli.common import _dummy_config, parse_weight_dtype, weight_format_from_options
    from engine.sources import store
    from engine.memory.budget import (CLI_KEYS, check_budget, drafter_plan, dummy_formats, fit_to_budget, model_formats,
                                      run_settings)
    from engine.memory.limit import limit_device_memory
    from engine.memory.plan import make_plan
    from engine.run.config import parse_bytes

    from engine.errors import BonsaiError
    fmt = weight_format_from_options(weights, group_size, head_weights)  # the options' own one-line errors first
    if load_format not in ("auto", "dummy"):
        raise BonsaiError(f"unknown --load-format '{load_format}': use auto or dummy")
    limit = parse_bytes(limit_text, "--max-gpu-memory") if limit_text else None
    cuda = device.startswith("cuda")
    if load_format == "dummy":
        config, path = _dummy_config(model)
        mw = dummy_formats(config, fmt, name=path.stem)
        wbytes = None
    else:
        from engine.weights.loader import open_model_source
        source = open_model_source(store.resolve_model(model or store.DEFAULT_MODEL, auto_pull=auto_pull))
        mw = model_formats(source, source.model_config(), fmt, keep_codes=cuda)
        wdtype = parse_weight_dtype(weight_dtype)
        wbytes = None if wdtype is None else wdtype.itemsize
    rows = 1
    if spec_config is not None:  # the verify widths are captured before the first draft
        rows = min(spec_config.num_draft_tokens + 1, 16)
    settings = run_settings(mw.config, device, max_seq_len, kv_type=kv_type, kv_offload=kv_offload,
                            graph_rows=0 if kv_offload or not cuda else rows,
                            weight_dtype_bytes=wbytes,
                            rotation_block=mw.rotation_block, dummy=load_format == "dummy",
                            embedding_on_host=bool(embedding_on_host), prefill_chunk_size=prefill_chunk_size)
    drafter = drafter_plan(spec_config, settings) if spec_config is not None else None
    settings, choices = fit_to_budget(mw, settings, limit, embedding_auto=embedding_on_host is None, chunk_auto=True,
                                      drafter=drafter)
    plan = make_plan(mw.config, mw.formats, settings, drafter)
    check_budget(plan, limit, mw, settings, CLI_KEYS, option="--max-gpu-memory", drafter=drafter)
    if limit is not None:
        limit_device_memory(limit, device)
    return Budget(limit, plan, settings, choices)


def memory_report(budget: Budget, device) -> dict[str, Any]:
    """Planned bytes against the allocator's peaks (the bench report's 'memory' entry)."""
    import torch

    from engine.memory.limit import usage
    cuda = torch.device(device).type == "cuda"
    used = usage(device)
    return {"planned_bytes": budget.plan.total, "planned_by_category": budget.plan.categories(),
            "max_gpu_memory": budget.limit, "chosen_to_fit": {c.key: c.value for c in budget.choices},
            "embedding_on_host": budget.settings.embedding_on_host,
            "prefill_chunk_size": budget.settings.prefill_chunk_size,
            "peak_allocated_bytes": used["peak_allocated"] if cuda else None,  # no allocator statistics on the CPU
            "peak_reserved_bytes": used["peak_reserved"] if cuda else None}
