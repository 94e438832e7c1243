"""`bonsai quantize SRC OUT`."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import typer

from bonsai_cli.common import err_console, print_json


def quantize(
    src: str = typer.Argument(..., help="the float model: a HF directory, a .gguf file or a pulled name"),
    out: Path = typer.Argument(..., help="the checkpoint directory to write"),
    quant_type: Optional[str] = typer.Option(None, "--quant-type", help="tri | tri-dense | bin | int4 | int8 (default tri)"),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="weights per scale along the input dimension (default 128)"),
    method: str = typer.Option("rtn", "--method", help="rtn | gptq | gsq"),
    sensitive_layers: Optional[str] = typer.Option(None, "--sensitive-layers",
                                                   help="comma-separated names or regexes kept at --sensitive-bits (e.g. q_proj,k_proj,v_proj,o_proj)"),
    sensitive_bits: int = typer.Option(4, "--sensitive-bits", help="bits of the sensitive layers: 8, 4, 2 or 1"),
    embed_bits: Optional[int] = typer.Option(None, "--embed-bits", help="bits of the embedding (default 16 = bf16)"),
    head_bits: Optional[int] = typer.Option(None, "--head-bits", help="bits of the output layer (default 16 = bf16)"),
    auto: bool = typer.Option(False, "--auto", help="llama.cpp's rule: v_proj and the first/last eighth of down_proj at int4"),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="YAML recipe with ordered pattern rules"),
    calib: Optional[Path] = typer.Option(None, "--calib", help="calibration text (UTF-8) for gptq / gsq"),
    calib_samples: int = typer.Option(128, "--calib-samples", help="calibration sequences"),
    calib_seq_len: int = typer.Option(512, "--calib-seq-len", help="tokens per calibration sequence"),
    gsq_steps: int = typer.Option(200, "--gsq-steps", help="gsq: learned-rounding steps per layer"),
    scale_refits: int = typer.Option(1, "--scale-refits", help="gptq / gsq: rounds of least-squares group scales "
                                     "for GPTQ's codes (0: GPTQ's own scales)"),
    tune_scales: int = typer.Option(0, "--tune-scales", help="gptq / gsq: then train every group scale end to end "
                                    "(KL to the float model on the calibration text, codes fixed) for this many steps"),
    tune_lr: float = typer.Option(5e-4, "--tune-lr", help="--tune-scales: Adam step of log(scale)"),
    rotate: bool = typer.Option(False, "--rotate", help="fold the norms and a randomized Hadamard rotation of the "
                                "residual stream into the weights before quantizing (QuaRot-style)"),
    online_hadamard: bool = typer.Option(True, "--online-hadamard/--no-online-hadamard",
                                         help="with --rotate: also a Hadamard on down_proj's input, applied at run "
                                         "time (llama.cpp cannot: --gguf needs --no-online-hadamard)"),
    lora: Optional[Path] = typer.Option(None, "--lora", help="PEFT LoRA adapter directory merged into the weights first"),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="also write a GGUF llama.cpp reads"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N] (gptq / gsq)"),
    force: bool = typer.Option(False, "--force", help="replace OUT (and the --gguf file) if they exist"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object on stdout"),
) -> None:
    """Quantize a model to ternary / 1-bit / int4 / int8 weights: a bonsai checkpoint (and a GGUF)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bonsai_cli.recipe_file import build_recipe, read_recipe_file
    from engine.sources import store
    from engine.weights.loader import resolve_device
    from engine.quantization.quantize import QuantizeOptions
    from engine.quantization.quantize import quantize as run_quantize

    file_data = read_recipe_file(recipe) if recipe else None
    built = build_recipe(file_data, quant_type=quant_type, group_size=group_size, sensitive_layers=sensitive_layers,
                         sensitive_bits=sensitive_bits, embed_bits=embed_bits, head_bits=head_bits, auto=auto,
                         where=str(recipe) if recipe else "the recipe")
    resolve_device(device)
    opts = QuantizeOptions(recipe=built, method=method, calib=calib, calib_samples=calib_samples,
                           calib_seq_len=calib_seq_len, gsq_steps=gsq_steps, scale_refits=scale_refits,
                           tune_steps=tune_scales, tune_lr=tune_lr, lora=lora, gguf=gguf, device=device,
                           force=force, rotate=rotate, online_hadamard=online_hadamard)
    path = store.resolve_model(src)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a killed run removes its temporary files too
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    try:
        with Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
            task = bar.add_task("quantizing", total=None)
            report = run_quantize(path, out, opts, progress=lambda message, done, total: bar.update(
                task, description=message, completed=done, total=total))
    finally:
        signal.signal(signal.SIGTERM, previous)
    if json_out:
        print_json(report.as_dict())
        return
    print_report(report)


def _interrupt(signum, frame):  # noqa: ANN001
    raise KeyboardInterrupt


def print_report(report) -> None:  # noqa: ANN001
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rotated = ""
    if report.rotation:
        block = report.rotation.get("down_proj_hadamard")
        rotated = f" · rotated{f' (online Hadamard {block} on down_proj)' if block else ''}"
    formats = Table("format", "tensors", "parameters", "MiB", "bits/weight",
                    title=f"{report.out} · {report.method}{rotated} · {report.seconds:.1f}s · "
                          f"peak RSS {report.peak_rss_bytes / 2**20:,.0f} MiB")
    for name, row in sorted(report.by_format().items(), key=lambda kv: -kv[1]["params"]):
        formats.add_row(name, str(row["tensors"]), f"{row['params']:,}", f"{row['bytes'] / 2**20:,.2f}",
                        f"{row['bits_per_weight']:.3f}")
    formats.add_row("total", str(len(report.tensors)), f"{report.params:,}", f"{report.nbytes / 2**20:,.2f}",
                    f"{report.bits_per_weight:.3f}", style="bold")
    console.print(formats)
    errors = Table("tensor class", "relative weight error ‖W-Ŵ‖/‖W‖", title="quantization error")
    for name, err in report.error_by_class().items():
        errors.add_row(name, f"{err:.4f}")
    console.print(errors)
    tuning = report.scale_tuning
    if tuning:
        verdict = "kept" if tuning["kept"] else "not kept: it did not lower the held-out KL, GPTQ/GSQ scales written"
        console.print(f"scale tuning, {tuning['steps']} steps on {tuning['train_sequences']} sequences: mean KL to the "
                      f"float model on {tuning['held_out_sequences']} held-out sequences {tuning['kl_before']:.4f} → "
                      f"{tuning['kl_after']:.4f} ({verdict})")
    kept = sum(t.kept for t in report.tensors)
    if kept:
        console.print(f"{kept} tensors kept as the source stored them (no requantization)")
    if report.gguf is not None:
        g = report.gguf.as_dict()
        table = Table("conversion", "tensors", "relative weight error", title=f"GGUF {g['path']}")
        for name, row in g["conversions"].items():
            table.add_row(name, str(row["tensors"]), f"{row['relative_error']:.5f}")
        console.print(table)
        if not report.gguf.lossless:
            console.print(f"[yellow]the GGUF export is lossy: relative weight error {g['relative_error']:.5f} against "
                          "the checkpoint (scales merged into the GGUF types' blocks, or float16 rounding)[/yellow]")
