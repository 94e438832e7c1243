"""`bonsai pull NAME`."""
from __future__ import annotations

import typer

from bonsai_cli.common import err_console


def pull(name: str = typer.Argument(..., help="'smollm2-135m' (built in) or a Hugging Face repo id")) -> None:
    """Download a model into the store ($BONSAI_HOME, default ~/.cache/bonsai)."""
    from engine.sources import store

    path = store.pull(name, log=lambda s: err_console.print(s), show_progress=err_console.is_terminal)
    typer.echo(str(path))
