"""--device cuda:0,cuda:1 --pipeline-parallel for `bonsai generate` and `bonsai bench`.

The same design as the serve config (runtime.device list + memory.pipeline_parallel: true): the
listed devices each run one stage (a contiguous part of the layers, balanced by planned bytes), one
process per device; `cpu,cpu` runs two CPU processes (gloo), the same code as two GPUs (NCCL).
"""
from __future__ import annotations

from typing import Any, Optional

from bonsai_cli.common import err_console

PIPELINE_HELP = ("split the model's layers across the devices listed in --device (e.g. cuda:0,cuda:1; cpu,cpu "
                 "runs two CPU processes), one process per device, balanced by bytes (bonsai info --plan shows "
                 "the split)")
DEVICE_HELP = "cpu or cuda[:N]; with --pipeline-parallel a list such as cuda:0,cuda:1 (or cpu,cpu)"


def pipeline_devices(device: str, pipeline_parallel: bool, kv_offload: bool = False, spec_config: Any = None
                     ) -> list[str] | None:
    """The stage devices (None: one device, no pipeline); every refusal comes before loading."""
    from engine.pipeline.devices import check_machine_devices, check_pipeline_request
    from engine.pipeline.setup import check_pipeline_options
    devices = check_pipeline_request(device, pipeline_parallel, where="--device", flag="--pipeline-parallel")
    if devices is not None:
        check_machine_devices(devices)
        check_pipeline_options(kv_offload=kv_offload, spec_config=spec_config)
    return devices


def open_cli_pipeline(model: Optional[str], devices: list[str], max_seq_len: int, limit_text: Optional[str],
                      load: dict[str, Any], kv_type: str = "bf16", quiet: bool = False, auto_pull: bool = False):
    """(PipelineRunner, Budget of stage 0, PipelinePlan): the stages planned from the model's metadata,
    checked against --max-gpu-memory per device, then started. load: load_for_cli's options."""
    from bonsai_cli.common import _dummy_config, parse_weight_dtype, weight_format_from_options
    from bonsai_cli.gpu_budget import Budget
    from engine.sources import store
    from engine.memory.budget import dummy_formats, model_formats, run_settings
    from engine.pipeline.launch import ModelSource
    from engine.pipeline.setup import check_pipeline_budget, open_pipeline, plan_pipeline
    from engine.run.config import parse_bytes

    load = {"weight_dtype": "auto", "weights": "bf16", "group_size": 128, "head_weights": "bf16",
            "load_format": "auto", **load}
    fmt = weight_format_from_options(load["weights"], load["group_size"], load["head_weights"])
    limit = parse_bytes(limit_text, "--max-gpu-memory") if limit_text else None
    cuda = devices[0].startswith("cuda")
    dummy = load["load_format"] == "dummy"
    wdtype = parse_weight_dtype(load["weight_dtype"])
    if dummy:
        config, path = _dummy_config(model)
        weights = dummy_formats(config, fmt, name=path.stem)
        source = ModelSource(architecture=config, name=path.stem, weight_format=fmt)
    else:
        from engine.weights.loader import open_model_source
        path = store.resolve_model(model or store.DEFAULT_MODEL, auto_pull=auto_pull or model is None)
        src = open_model_source(path)
        weights = model_formats(src, src.model_config(), fmt, keep_codes=cuda)
        source = ModelSource(path=str(path), weight_dtype=wdtype, weight_format=fmt)
    settings = run_settings(weights.config, devices[0], max_seq_len, kv_type=kv_type,
                            weight_dtype_bytes=None if wdtype is None else wdtype.itemsize,
                            rotation_block=weights.rotation_block, dummy=dummy)
    pp = plan_pipeline(weights.config, weights.formats, settings, devices)
    check_pipeline_budget(pp, limit, "--max-gpu-memory")
    split = ", ".join(f"{s.device}: {s.label}" for s in pp.stages)
    if quiet:
        runner = open_pipeline(source, pp, max_seq_len, kv_type=kv_type, max_gpu_memory=limit)
    else:
        with err_console.status(f"loading {path.name if hasattr(path, 'name') else path} in "
                                f"{len(pp.stages)} pipeline stages ({split})"):
            runner = open_pipeline(source, pp, max_seq_len, kv_type=kv_type, max_gpu_memory=limit)
        err_console.print(f"[dim]pipeline over {len(pp.stages)} devices ({pp.backend}): {split}[/dim]")
    return runner, Budget(limit, pp.plans[0], settings), pp
