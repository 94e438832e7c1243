"""Helpers shared by the commands: stderr console, model resolution and loading with a spinner."""
from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

err_console = Console(stderr=True)


def print_json(obj: Any) -> None:
    """The one JSON object a --json command prints on stdout."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


WEIGHT_DTYPE_HELP = ("matrix storage: auto (on CPU float16 matrices: ~1.75x faster decode, mean KL 2e-6 vs "
                     "float32, greedy output may differ at exact near-ties; on GPU the compute dtype), "
                     "float32 (exact), float16, bfloat16")


def parse_weight_dtype(name: str):
    import torch

    from engine.errors import BonsaiError
    choices = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in choices:
        raise BonsaiError(f"unknown --weight-dtype '{name}': use one of {', '.join(choices)}")
    return choices[name]


def load_for_cli(model: str | None, device: str, quiet: bool = False, auto_pull: bool = False,
                 weight_dtype: str = "auto"):
    """Resolve MODEL (path or pulled name; the default model when None) and load it."""
    from engine import store
    from engine.loader import load_model

    wdtype = parse_weight_dtype(weight_dtype)

    spec = model or store.DEFAULT_MODEL
    log = (lambda s: None) if quiet else (lambda s: err_console.print(f"[dim]{s}[/dim]"))
    path = store.resolve_model(spec, auto_pull=auto_pull or model is None, log=log)
    if quiet:
        return load_model(path, device=device, weight_dtype=wdtype)
    with err_console.status(f"loading {path.name} on {device}"):
        loaded = load_model(path, device=device, weight_dtype=wdtype)
    err_console.print(f"[dim]loaded {loaded.config.architecture} model {path.name} "
                      f"({loaded.summary.num_parameters / 1e6:.0f}M parameters) in {loaded.load_seconds:.1f}s[/dim]")
    return loaded
