"""`bonsai info MODEL [--plan serve.yaml]`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from bonsai_cli.common import print_json
from bonsai_cli.run_options import LOAD_FORMAT_HELP, WEIGHTS_HELP


def info(model: Optional[str] = typer.Argument(None, help="a .gguf file, a model directory or a pulled name "
                                               "(with --plan: default the config's model.path)"),
         plan: Optional[Path] = typer.Option(None, "--plan", help="serve.yaml: print the GPU memory plan of "
                                             "serving MODEL with it (weights, KV cache, buffers) and check "
                                             "memory.max_gpu_memory"),
         load_format: str = typer.Option("auto", "--load-format", help=LOAD_FORMAT_HELP),
         weights: str = typer.Option("bf16", "--weights", help="with --load-format dummy: " + WEIGHTS_HELP),
         group_size: int = typer.Option(128, "--group-size", help="with --load-format dummy"),
         head_weights: str = typer.Option("bf16", "--head-weights", help="with --load-format dummy"),
         json_out: bool = typer.Option(False, "--json", help="print one JSON object on stdout")) -> None:
    """Architecture, parameter count, tensor types, bytes and bits per weight (reads no weights);
    with --plan, every byte serving it would put on the GPU."""
    from rich.console import Console
    from rich.table import Table

    from engine.sources import store
    from engine.errors import BonsaiError
    from engine.weights.loader import open_model_source, summarize

    if plan is not None:
        _info_plan(model, plan, json_out)
        return
    if model is None:
        raise BonsaiError("bonsai info needs MODEL (or --plan serve.yaml)")
    if load_format == "dummy":
        _info_dummy(model, weights, group_size, head_weights, json_out)
        return
    if load_format != "auto":
        raise BonsaiError(f"unknown --load-format '{load_format}': use auto or dummy")
    path = store.resolve_model(model)
    source = open_model_source(path)
    config = source.model_config()  # the architecture, checked against the tensors (engine.sources.model_check)
    source.tokenizer()  # what `generate` builds next: a broken tokenizer is refused here too
    summary = summarize(source)
    arch = {k: v for k, v in vars(config).items() if k != "extra"}
    arch["rope_scaling"] = vars(config.rope_scaling) if config.rope_scaling else None
    arch["hybrid"] = _hybrid_summary(config)
    if arch["hybrid"] is not None:  # its own MTP head, the --spec mtp drafter (engine.sources.mtp_source)
        from engine.sources.mtp_source import mtp_layer_count
        arch["hybrid"]["mtp_layers"] = mtp_layer_count(source, config.num_layers)
    rotation = getattr(source, "rotation", None)  # a checkpoint made with --rotate
    prism = getattr(source, "prism", None)  # a GGUF with PrismML's folded Hadamard rotation
    if prism is not None:
        rotation = prism.summary()
    if json_out:
        print_json({"path": str(path), "format": summary.format, "architecture": arch, "rotation": rotation,
                    "parameters": summary.num_parameters, "bytes": summary.file_bytes,
                    "bits_per_weight": summary.bits_per_weight,
                    "tensor_types": {t: {"tensors": n, "parameters": p, "bytes": b}
                                     for t, (n, p, b) in summary.types.items()}})
        return
    console = Console()
    console.print(f"[bold]{path}[/bold]  ({summary.format})")
    head = Table(show_header=False, box=None)
    for key in ("architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads",
                "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                "tie_word_embeddings", "qk_norm", "attention_bias"):
        head.add_row(key, str(arch[key]))
    _hybrid_rows(head, arch["hybrid"])
    head.add_row("parameters", f"{summary.num_parameters:,} ({summary.num_parameters / 1e6:.1f}M)")
    head.add_row("size", f"{summary.file_bytes / 2**20:,.1f} MiB")
    head.add_row("bits per weight", f"{summary.bits_per_weight:.3f}")
    if prism is not None:
        widths = ", ".join(map(str, rotation["sign_widths"]))
        head.add_row("rotation", f"Prism Hadamard, block {prism.block} "
                     f"({f'signs for widths {widths}' if widths else 'no signs'}) on the inputs of "
                     f"{rotation['weights']} weights" + (", embedding un-rotated" if rotation["embedding"] else ""))
    elif rotation:
        block = rotation.get("down_proj_hadamard")
        head.add_row("rotation", f"{rotation.get('residual')} (folded)"
                     + (f", online Hadamard {block} on down_proj's input" if block else ""))
    console.print(head)
    types = Table("tensor type", "tensors", "parameters", "MiB", "bits/weight")
    for t, (n, p, b) in summary.types.items():
        types.add_row(t, str(n), f"{p:,}", f"{b / 2**20:,.1f}", f"{8 * b / max(p, 1):.3f}")
    console.print(types)


def _hybrid_rows(table, mix: dict | None) -> None:
    """A hybrid's layer mix and per-sequence DeltaNet state, as rows of the info table."""
    if mix:
        table.add_row("layer mix", f"{mix['deltanet_layers']} Gated DeltaNet + {mix['attention_layers']} gated attention")
        table.add_row("state per sequence", f"{mix['state_bytes_per_sequence'] / 2**20:,.2f} MiB (DeltaNet, fp32; "
                      "plus the attention layers' KV)")
        if "mtp_layers" in mix:
            table.add_row("MTP head", f"{mix['mtp_layers']} layer (--spec mtp drafts with it)" if mix["mtp_layers"]
                          else "none in these files")


def _hybrid_summary(config) -> dict | None:
    """A hybrid model's layer mix and the DeltaNet state one sequence holds (engine.runtime.hybrid_state)."""
    hc = config.hybrid
    if hc is None:
        return None
    counts = hc.counts()
    return {**vars(hc), "deltanet_layers": counts["linear_attention"], "attention_layers": counts["full_attention"],
            "state_bytes_per_sequence": hc.state_bytes_per_slot(4)}


def _info_plan(model: Optional[str], plan_file: Path, json_out: bool) -> None:
    from rich.console import Console

    from bonsai_cli.plan_table import plan_dict, print_plan
    from bonsai_cli.run_options import architecture_of, run_config
    from engine.errors import BonsaiError
    from engine.memory.budget import SERVE_KEYS, check_budget
    from engine.run.plan import plan_run

    cfg = run_config(model, {}, plan_file)
    planned = plan_run(cfg, architecture_of(cfg))
    if cfg.memory.pipeline_parallel:
        _info_pipeline(cfg, planned, plan_file, json_out)
        return
    refusal = None
    try:
        check_budget(planned.plan, planned.limit, planned.weights, planned.settings, SERVE_KEYS,
                     drafter=planned.drafter)
    except BonsaiError as e:
        refusal = str(e)
    if json_out:
        print_json({"model": cfg.model.path, "config": str(plan_file),
                    **plan_dict(planned.plan, planned.settings, planned.limit, refusal, planned.choices,
                                planned.stream)})
        return
    print_plan(Console(), planned.plan, planned.settings, planned.limit, refusal,
               f"memory plan on {cfg.runtime.device}: {cfg.model.path} with {plan_file.name}", planned.choices,
               planned.stream)


def _info_pipeline(cfg, planned, plan_file: Path, json_out: bool) -> None:
    """The pipeline's split (which layers and bytes on each device) and each device's plan."""
    from rich.console import Console
    from rich.table import Table

    from bonsai_cli.plan_table import plan_dict, print_plan
    from engine.errors import BonsaiError
    from engine.pipeline.setup import check_pipeline_budget, plan_pipeline

    devices = cfg.runtime.devices
    backend = "gloo" if devices[0] == "cpu" else "nccl"  # the plan only: this machine's devices are not checked
    pp = plan_pipeline(planned.weights.config, planned.weights.formats, planned.settings, devices, backend)
    refusal = None
    try:
        check_pipeline_budget(pp, planned.limit, "config memory.max_gpu_memory")
    except BonsaiError as e:
        refusal = str(e)
    if json_out:
        print_json({"model": cfg.model.path, "config": str(plan_file), "pipeline": pp.as_dict(),
                    "devices": [plan_dict(p, planned.settings, planned.limit, None) for p in pp.plans],
                    "fits": refusal is None, "refusal": refusal})
        return
    console = Console()
    table = Table("stage", "device", "layers", "holds", "weights MiB", "KV MiB", "device total MiB",
                  title=f"pipeline of {cfg.model.path} over {len(devices)} devices ({backend})")
    for stage, plan in zip(pp.stages, pp.plans):
        holds = ", ".join(x for x, on in (("embedding", stage.takes_tokens), ("norm + output layer",
                                                                               stage.gives_logits)) if on)
        table.add_row(str(stage.index), stage.device, f"{stage.first}-{stage.end - 1} ({stage.num_layers})",
                      holds or "-", f"{stage.weight_bytes / 2**20:,.1f}", f"{stage.kv_bytes / 2**20:,.1f}",
                      f"{plan.total / 2**20:,.1f}")
    console.print(table)
    for stage, plan in zip(pp.stages, pp.plans):
        print_plan(console, plan, planned.settings, planned.limit, refusal if plan.total > (planned.limit or 0)
                   else None, f"memory plan of stage {stage.index} on {stage.device} ({stage.label})")


def _info_dummy(model: str, weights: str, group_size: int, head_weights: str, json_out: bool) -> None:
    """A generated (dummy) model: its architecture and the bytes of its weights in the given formats."""
    from rich.console import Console
    from rich.table import Table

    from bonsai_cli.run_options import dummy_architecture
    from engine.memory.budget import dummy_formats, run_settings
    from engine.memory.plan import weight_tensors
    from engine.weights.formats import WeightFormat

    config, path = dummy_architecture(model)
    formats = dummy_formats(config, WeightFormat(weights, group_size, head_weights)).formats
    nbytes = sum(size for _, _, size in weight_tensors(config, formats, run_settings(config, "cuda", 2)))
    params = config.num_parameters()
    arch = {k: v for k, v in vars(config).items() if k not in ("extra", "rope_scaling")}
    arch["hybrid"] = _hybrid_summary(config)
    if json_out:
        print_json({"path": str(path), "format": "dummy", "architecture": arch, "parameters": params,
                    "bytes": nbytes, "bits_per_weight": 8 * nbytes / params,
                    "weights": weights, "head_weights": head_weights, "group_size": group_size})
        return
    console = Console()
    console.print(f"[bold]{path}[/bold]  (dummy: generated {weights} weights, output layer {head_weights})")
    head = Table(show_header=False, box=None)
    for key, value in arch.items():
        if key != "hybrid":
            head.add_row(key, str(value))
    _hybrid_rows(head, arch["hybrid"])
    head.add_row("parameters", f"{params:,} ({params / 1e9:.2f}B)")
    head.add_row("size on a GPU", f"{nbytes / 2**20:,.1f} MiB (bfloat16 embedding)")
    head.add_row("bits per weight", f"{8 * nbytes / params:.3f}")
    console.print(head)
