"""`bonsai info MODEL`."""
from __future__ import annotations

import typer

from bonsai_cli.common import print_json


def info(model: str = typer.Argument(..., help="a .gguf file, a model directory or a pulled name"),
         json_out: bool = typer.Option(False, "--json", help="print one JSON object on stdout")) -> None:
    """Architecture, parameter count, tensor types, bytes and bits per weight (reads no weights)."""
    from rich.console import Console
    from rich.table import Table

    from engine import store
    from engine.loader import open_model_source, summarize

    path = store.resolve_model(model)
    source = open_model_source(path)
    config = source.model_config()
    summary = summarize(source)
    arch = {k: v for k, v in vars(config).items() if k != "extra"}
    arch["rope_scaling"] = vars(config.rope_scaling) if config.rope_scaling else None
    rotation = getattr(source, "rotation", None)  # a checkpoint made with --rotate
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
    head.add_row("parameters", f"{summary.num_parameters:,} ({summary.num_parameters / 1e6:.1f}M)")
    head.add_row("size", f"{summary.file_bytes / 2**20:,.1f} MiB")
    head.add_row("bits per weight", f"{summary.bits_per_weight:.3f}")
    if rotation:
        block = rotation.get("down_proj_hadamard")
        head.add_row("rotation", f"{rotation.get('residual')} (folded)"
                     + (f", online Hadamard {block} on down_proj's input" if block else ""))
    console.print(head)
    types = Table("tensor type", "tensors", "parameters", "MiB", "bits/weight")
    for t, (n, p, b) in summary.types.items():
        types.add_row(t, str(n), f"{p:,}", f"{b / 2**20:,.1f}", f"{8 * b / max(p, 1):.3f}")
    console.print(types)
