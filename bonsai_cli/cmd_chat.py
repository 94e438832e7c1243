"""`bonsai chat [MODEL]`: streaming chat in the terminal."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator, Optional

import typer

from bonsai_cli.cmd_generate import sampling_from_options
from bonsai_cli.common import spec_summary
from bonsai_cli.run_options import (CONFIG_HELP, DEVICE_HELP, DRAFT_TOKENS_HELP, KV_TYPE_HELP, SPEC_HELP,
                                    WEIGHT_DTYPE_HELP, CPU_INT4_HELP, CPU_KERNELS_HELP, OUTPUT_DTYPE_HELP, open_cli_run, run_config)

HELP_TEXT = ("commands: /reset (forget the conversation), /system TEXT (set the system message; "
             "/system alone clears it), /stats (speed of the last answer), /exit")


def chat(
    model: Optional[str] = typer.Argument(None, help="model path or pulled name (default: smollm2-135m, pulled on first use)"),
    system: Optional[str] = typer.Option(None, "--system", help="system message"),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="tokens per answer at most"),
    temperature: float = typer.Option(0.7, "--temperature", "-t"),
    top_p: float = typer.Option(0.95, "--top-p"),
    top_k: int = typer.Option(40, "--top-k"),
    min_p: float = typer.Option(0.05, "--min-p"),
    repeat_penalty: float = typer.Option(1.1, "--repeat-penalty"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    weight_dtype: Optional[str] = typer.Option(None, "--weight-dtype", help=WEIGHT_DTYPE_HELP + " (default auto)"),
    cpu_int4: Optional[bool] = typer.Option(None, "--cpu-int4/--no-cpu-int4", help=CPU_INT4_HELP),
    cpu_kernels: Optional[str] = typer.Option(None, "--cpu-kernels", help=CPU_KERNELS_HELP),
    output_dtype: Optional[str] = typer.Option(None, "--output-dtype", help=OUTPUT_DTYPE_HELP),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="context length to allocate "
                                              "(default 4096, or the model's positions if fewer)"),
    kv_type: Optional[str] = typer.Option(None, "--kv-type", help=KV_TYPE_HELP + " (default bf16)"),
    plain: bool = typer.Option(False, "--plain", help="print raw text instead of rendered markdown"),
    config: Optional[Path] = typer.Option(None, "--config", help=CONFIG_HELP + " (slots, thinking budget, "
                                          "context policy)"),
    spec: Optional[str] = typer.Option(None, "--spec", help=SPEC_HELP),
    draft_tokens: Optional[int] = typer.Option(None, "--draft-tokens", help=DRAFT_TOKENS_HELP + " (default 4)"),
) -> None:
    """Chat with a model in the terminal; the conversation stays in the KV cache between turns."""
    from rich.console import Console

    from engine.decoding.chat import ChatSession
    from engine.errors import BonsaiError

    console = Console()
    sampling = sampling_from_options(temperature, top_p, top_k, min_p, repeat_penalty, 0.0, 0.0, seed)
    cfg = run_config(model, {"--device": device, "--weight-dtype": weight_dtype,
                             "--cpu-int4": cpu_int4, "--cpu-kernels": cpu_kernels, "--output-dtype": output_dtype, "--max-seq-len": max_seq_len,
                             "--kv-type": kv_type, "--spec": spec, "--draft-tokens": draft_tokens}, config)
    with contextlib.closing(open_cli_run(cfg, auto_pull=model is None and config is None,
                                         from_flags=config is None)) as run:
        session = ChatSession(run.engine(), system=system, compress_at=cfg.context.compress_at,
                              thinking_budget=cfg.thinking.budget)
        render_markdown = console.is_terminal and not plain
        console.print(f"[dim]{HELP_TEXT}[/dim]")
        for text in _user_lines(console):
            if text.startswith("/"):
                if not _command(text, session, console):
                    break
                continue
            console.print("[bold cyan]bonsai>[/bold cyan]", end="\n" if render_markdown else " ")
            try:
                _answer(session, text, max_tokens, sampling, console, render_markdown)
            except KeyboardInterrupt:
                console.print("\n[dim](answer interrupted)[/dim]")
            except BonsaiError as e:
                console.print(f"[red]error: {e}[/red]")
                if "context" in str(e):
                    console.print("[dim]use /reset to start a new conversation[/dim]")


def _user_lines(console) -> Iterator[str]:
    """The user's non-empty lines (prompted on a terminal, read plainly from a pipe) until EOF."""
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = console.input("[bold green]you> [/bold green]") if interactive else _read_line(console)
        except EOFError:
            return
        if line.strip():
            yield line.strip()


def _read_line(console) -> str:
    console.print("you> ", end="")
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    console.print(line.rstrip("\n"))
    return line


def _answer(session, text: str, max_tokens: int, sampling, console, render_markdown: bool) -> None:
    """Stream one answer: a thought dimmed as it comes, then the answer (rendered as markdown on a terminal)."""
    pieces: list[str] = []
    thinking = False
    live = None
    try:
        for event in session.send(text, max_tokens, sampling):
            if event.reasoning:
                thinking = True
                console.out(event.reasoning, end="", style="dim", highlight=False)
            if not event.text:
                continue
            if thinking:
                console.out("\n", end="")
                thinking = False
            pieces.append(event.text)
            if render_markdown:
                if live is None:
                    from rich.live import Live
                    from rich.markdown import Markdown
                    live = Live(Markdown(""), console=console, refresh_per_second=12, vertical_overflow="ellipsis")
                    live.start()
                live.update(Markdown("".join(pieces)))
            else:
                console.out(event.text, end="", highlight=False)
    finally:
        if live is not None:
            live.stop()
    if not render_markdown:
        console.out("")
    s = session.last_stats
    if s is not None:
        console.print(f"[dim]{s.generated_tokens} tokens, {s.decode_tokens_per_second:.1f} tok/s, "
                      f"first token after {s.ttft_seconds * 1000:.0f} ms[/dim]")


def _command(text: str, session, console) -> bool:
    """Run a /command; False means leave the chat."""
    name, _, arg = text.partition(" ")
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name == "/reset":
        session.reset()
        console.print("[dim]conversation cleared[/dim]")
    elif name == "/system":
        session.set_system(arg.strip())
        session.reset()
        console.print(f"[dim]system message {'set' if arg.strip() else 'cleared'}; conversation cleared[/dim]")
    elif name == "/stats":
        s = session.last_stats
        if s is None:
            console.print("[dim]no answer yet[/dim]")
        else:
            used = s.prompt_tokens + s.generated_tokens
            console.print(f"[dim]prompt {s.prompt_tokens} tokens ({s.cached_tokens} reused from cache) at "
                          f"{s.prefill_tokens_per_second:.1f} tok/s; {s.generated_tokens} generated at "
                          f"{s.decode_tokens_per_second:.1f} tok/s; context {used}/{session.engine.slot_context}[/dim]")
            if s.speculative is not None:
                console.print(f"[dim]{spec_summary(s.speculative)}[/dim]")
    else:
        console.print(f"[yellow]unknown command {name}[/yellow]; {HELP_TEXT}")
    return True
