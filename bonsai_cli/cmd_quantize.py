"""`bonsai quantize SRC OUT`."""
from __future__ import annotations

import signal
from pathlib import Path
from typing import Optional

import typer

from bonsai_cli.common import err_console, print_json
from engine.errors import BonsaiError


def quantize(
    src: str = typer.Argument(..., help="the float model: a HF directory, a .gguf file or a pulled name"),
    out: Path = typer.Argument(..., help="the checkpoint directory to write"),
    quant_type: Optional[str] = typer.Option(None, "--quant-type", help="tri | tri-dense | bin | int4 | int8 (default tri)"),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="weights per scale along the input dimension (default 128)"),
    method: str = typer.Option("gptq", "--method", help="gptq (default: error feedback on calibration text) | "
                               "gsq (learned rounding, ~5x gptq's time) | rtn (round to nearest: the fast path)"),
    sensitive_layers: Optional[str] = typer.Option(None, "--sensitive-layers",
                                                   help="comma-separated names or regexes kept at --sensitive-bits (e.g. q_proj,k_proj,v_proj,o_proj)"),
    sensitive_bits: int = typer.Option(4, "--sensitive-bits", help="bits of the sensitive layers: 8, 4, 2 or 1"),
    embed_bits: Optional[int] = typer.Option(None, "--embed-bits", help="bits of the embedding (default 16 = bf16)"),
    head_bits: Optional[int] = typer.Option(None, "--head-bits", help="bits of the output layer (default 16 = bf16)"),
    auto: bool = typer.Option(False, "--auto", help="llama.cpp's rule: v_proj and the first/last eighth of down_proj at int4"),
    recipe: Optional[Path] = typer.Option(None, "--recipe", help="YAML recipe with ordered pattern rules"),
    calib: Optional[Path] = typer.Option(None, "--calib", help="calibration text (UTF-8) for gptq / gsq (default: "
                                         "docstrings of Python's standard library)"),
    calib_samples: int = typer.Option(64, "--calib-samples", help="calibration sequences"),
    calib_seq_len: int = typer.Option(256, "--calib-seq-len", help="tokens per calibration sequence"),
    gsq_steps: int = typer.Option(200, "--gsq-steps", help="gsq: learned-rounding steps per layer"),
    scale_refits: int = typer.Option(1, "--scale-refits", help="gptq / gsq: rounds of least-squares group scales "
                                     "for GPTQ's codes (0: GPTQ's own scales)"),
    tune_scales: int = typer.Option(0, "--tune-scales", help="gptq / gsq: then train every group scale end to end "
                                    "(KL to the float model on the calibration text, codes fixed) for this many steps"),
    tune_lr: float = typer.Option(5e-4, "--tune-lr", help="--tune-scales: Adam step of log(scale)"),
    block_tune_steps: Optional[int] = typer.Option(None, "--block-tune-steps", help="gptq / gsq: Adam steps per "
                                                   "layer that train the layer's group scales on its output against "
                                                   "the float model's (codes fixed, layer by layer; 0: off; default "
                                                   "50 for gptq / gsq)"),
    block_tune_lr: Optional[float] = typer.Option(None, "--block-tune-lr", help="--block-tune-steps: Adam step of "
                                                  "log(scale) (default 5e-3)"),
    asymmetric: Optional[float] = typer.Option(None, "--asymmetric", help="gptq / gsq: share (0-1) of the float "
                                               "model's outputs on its own inputs in each layer's fit (0: plain "
                                               "GPTQ, its outputs on the quantized model's inputs; default 0.25)"),
    rotate: Optional[bool] = typer.Option(None, "--rotate/--no-rotate", help="fold the norms and a randomized "
                                          "Hadamard rotation of the residual stream into the weights before "
                                          "quantizing (QuaRot-style; default: on for gptq / gsq where the hidden size "
                                          "has a Hadamard matrix)"),
    online_hadamard: Optional[bool] = typer.Option(None, "--online-hadamard/--no-online-hadamard",
                                                   help="with --rotate: also a Hadamard on down_proj's input, applied "
                                                   "at run time (default: on, off with --gguf: llama.cpp cannot apply it)"),
    lora: Optional[Path] = typer.Option(None, "--lora", help="PEFT LoRA adapter directory merged into the weights first"),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="also write a GGUF llama.cpp reads (every tensor in "
                                        "a type that holds its codes exactly, or refused)"),
    allow_lossy_gguf: bool = typer.Option(False, "--allow-lossy-gguf", help="--gguf: write tensors no llama.cpp type "
                                          "holds exactly with merged scales (the report says their error)"),
    evaluate: bool = typer.Option(True, "--eval/--no-eval", help="score the checkpoint against the source on "
                                  "held-out text at the end (KL, same-top, perplexity; quality.json)"),
    eval_tokens: int = typer.Option(2048, "--eval-tokens", help="tokens of held-out text scored (512-token windows)"),
    eval_text: Optional[Path] = typer.Option(None, "--eval-text", help="held-out text (default: Python's pydoc topics)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads (default: all cores)"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N] (gptq / gsq)"),
    force: bool = typer.Option(False, "--force", help="replace OUT (and the --gguf file) if they exist"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object on stdout"),
) -> None:
    """Quantize a model to ternary / 1-bit / int4 / int8 weights: a bonsai checkpoint (and a GGUF).

    Layer by layer: one decoder layer of the source is in memory at a time. Peak memory ≈ 0.5 GiB
    + 4 B × (one layer's parameters) + 4 B × calibration tokens × (3·hidden + ffn) + the larger of
    GPTQ's (4·b·K² + 12·N·K; K the widest input, b 8 bytes up to K = 8192 else 4), the output
    layer's (its codes, V·H bytes, + 1 GiB of row slices) and block tuning's (9 B × one layer's parameters
    + one minibatch's activations; its float stream, also --asymmetric's, adds 8 B × calibration tokens × hidden;
    --asymmetric adds to GPTQ's the cross term of the widest input, 4·N·K or b·K², and a fourth candidate: that
    input's sums with the float copies they are made from); predicted and printed before
    starting. gptq / gsq fit each layer partly to the float model's outputs (--asymmetric), then train each
    layer's group scales on its output (--block-tune-steps).
    """
    import os

    import torch
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    from bonsai_cli.recipe_file import build_recipe, read_recipe_file
    from engine.sources import store
    from engine.weights.loader import resolve_device
    from engine.quantization.paths import check_writable
    from engine.quantization.quantize import ASYMMETRIC, BLOCK_TUNE_LR, BLOCK_TUNE_STEPS, QuantizeOptions
    from engine.quantization.quantize import quantize as run_quantize

    file_data = read_recipe_file(recipe) if recipe else None
    built = build_recipe(file_data, quant_type=quant_type, group_size=group_size, sensitive_layers=sensitive_layers,
                         sensitive_bits=sensitive_bits, embed_bits=embed_bits, head_bits=head_bits, auto=auto,
                         where=str(recipe) if recipe else "the recipe")
    resolve_device(device)
    if threads is not None and threads < 1:
        raise BonsaiError(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads or os.cpu_count() or 1)
    if rotate is None:
        rotate = method != "rtn" and default_rotation(store.resolve_model(src))
    if online_hadamard is None:
        online_hadamard = gguf is None
    opts = QuantizeOptions(recipe=built, method=method, calib=calib, calib_samples=calib_samples,
                           calib_seq_len=calib_seq_len, gsq_steps=gsq_steps, scale_refits=scale_refits,
                           tune_steps=tune_scales, tune_lr=tune_lr,
                           block_tune_steps=(block_tune_steps if block_tune_steps is not None
                                             else 0 if method == "rtn" else BLOCK_TUNE_STEPS),
                           block_tune_lr=BLOCK_TUNE_LR if block_tune_lr is None else block_tune_lr,
                           asymmetric=(asymmetric if asymmetric is not None else 0.0 if method == "rtn" else ASYMMETRIC),
                           lora=lora, gguf=gguf, device=device,
                           force=force, rotate=rotate, online_hadamard=online_hadamard, evaluate=evaluate,
                           eval_tokens=eval_tokens, eval_text=eval_text, allow_lossy_gguf=allow_lossy_gguf)
    path = store.resolve_model(src)
    check_writable(out, gguf)  # a read-only place fails here, not after the work
    stop = _StopRequest()  # Ctrl-C / a kill: stop between two steps, remove the temporary files, exit 130
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    try:
        with Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
            task = bar.add_task("quantizing", total=None)

            def progress(message: str, done: int, total: int) -> None:
                stop.check()
                bar.update(task, description=message, **({"completed": done, "total": total} if total else {}))
            report = run_quantize(path, out, opts, progress=progress,
                                  announce=lambda parts: err_console.print(peak_line(parts)))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if json_out:
        print_json(report.as_dict())
        return
    print_report(report)


def default_rotation(path) -> bool:  # noqa: ANN001
    """Whether the default --rotate applies: the model's hidden size has a Hadamard matrix."""
    from engine.weights.loader import open_model_source
    from quant.rotation import has_hadamard
    source = open_model_source(path)
    return has_hadamard(source.model_config().hidden_size) and not getattr(source, "rotation", None)


def peak_line(parts: dict[str, int]) -> str:
    gib = {k: v / 2 ** 30 for k, v in parts.items()}
    return (f"predicted peak memory {gib['total']:.2f} GiB (base {gib['base']:.2f} + one layer {gib['layer']:.2f} + "
            f"calibration activations {gib['activations']:.2f} + max(GPTQ {gib['gptq']:.2f}, output layer "
            f"{gib['output layer']:.2f}" + (f", block tuning {gib['block tuning']:.2f}" if parts.get("block tuning") else "")
            + (f", asymmetric sums {gib['asymmetric']:.2f}" if parts.get("asymmetric") else "") + "))")


class _StopRequest:
    """The signal handler of a quantize run. An exception raised from a signal handler lands wherever the
    main thread is, even inside a lazy import of torch's extensions (seen: a fatal abort with the partial
    output left behind, or an interrupt no handler caught). So the first signal only records the request,
    which the next progress report (between two tensors or layers, at most a few seconds apart) acts on;
    a second signal stops at once."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum, frame) -> None:  # noqa: ANN001
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.count:
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
    if report.block_tuning:
        layers = report.block_tuning
        kept = [r for r in layers if r["kept"]]
        mean = lambda key: sum(r[key] for r in kept) / max(len(kept), 1)  # noqa: E731
        console.print(f"block tuning, {layers[0]['steps']} steps a layer: tuned scales kept in {len(kept)} of "
                      f"{len(layers)} layers (the others kept GPTQ's); their held-out output error "
                      f"{mean('held_out_before'):.4f} → {mean('held_out_after'):.4f} on average, "
                      f"{sum(r['cpu_seconds'] for r in layers):.0f} CPU s")
    tuning = report.scale_tuning
    if tuning:
        verdict = "kept" if tuning["kept"] else "not kept: it did not lower the held-out KL, GPTQ/GSQ scales written"
        console.print(f"scale tuning, {tuning['steps']} steps on {tuning['train_sequences']} sequences: mean KL to the "
                      f"float model on {tuning['held_out_sequences']} held-out sequences {tuning['kl_before']:.4f} → "
                      f"{tuning['kl_after']:.4f} ({verdict})")
    for group, kinds in report.group_fallbacks.items():
        console.print(f"the group size does not divide the input dimension of {', '.join(kinds)}: "
                      f"those tensors use group {group}")
    if report.mtp_head:
        mtp_bytes = sum(t.nbytes for t in report.mtp_head)
        console.print(f"the model's MTP head (the --spec mtp drafter): {len(report.mtp_head)} tensors copied as bf16, "
                      f"{mtp_bytes / 2**20:,.2f} MiB (not in the totals above)")
    console.print(f"peak RSS {report.peak_rss_bytes / 2**30:.2f} GiB (predicted {report.predicted_peak_bytes / 2**30:.2f} GiB)")
    if report.quality:
        q = report.quality
        quality = Table("tokens", "ppl", "source ppl", "ppl ratio", "mean KL", "p99 KL", "same top",
                        title=f"quality against the source (held-out {q['text']}, {q['context']}-token windows)")
        quality.add_row(str(q["tokens"]), f"{q['perplexity']:.3f}", f"{q['reference_perplexity']:.3f}",
                        f"{q['perplexity'] / q['reference_perplexity']:.3f}x", f"{q['kl_mean']:.4f}",
                        f"{q['kl_p99']:.4f}", f"{100 * q['same_top']:.1f}%")
        console.print(quality)
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
            cost = ""
            if report.gguf_quality and report.quality:
                q, c = report.gguf_quality, report.quality
                cost = (f"; against the source: mean KL {q['kl_mean']:.4f} (checkpoint {c['kl_mean']:.4f}), ppl "
                        f"{q['perplexity']:.3f} (checkpoint {c['perplexity']:.3f})")
            console.print(f"[yellow]the GGUF export is lossy (--allow-lossy-gguf): relative weight error "
                          f"{g['relative_error']:.5f} against the checkpoint (scales merged into the GGUF types' "
                          f"blocks){cost}[/yellow]")
