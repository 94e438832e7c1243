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


def load_for_cli(model: str | None, device: str, quiet: bool = False, auto_pull: bool = False):
    """Resolve MODEL (path or pulled name; the default model when None) and load it."""
    from engine import store
    from engine.loader import load_model

    spec = model or store.DEFAULT_MODEL
    log = (lambda s: None) if quiet else (lambda s: err_console.print(f"[dim]{s}[/dim]"))
    path = store.resolve_model(spec, auto_pull=auto_pull or model is None, log=log)
    if quiet:
        return load_model(path, device=device)
    with err_console.status(f"loading {path.name} on {device}"):
        loaded = load_model(path, device=device)
    err_console.print(f"[dim]loaded {loaded.config.architecture} model {path.name} "
                      f"({loaded.summary.num_parameters / 1e6:.0f}M parameters) in {loaded.load_seconds:.1f}s[/dim]")
    return loaded
