"""The memory plan as a rich table or a JSON-ready dict (bonsai info --plan, generate/bench budgets)."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def plan_dict(plan, settings, limit: int | None, refusal: str | None, choices=(), stream=None) -> dict[str, Any]:
    return {**plan.as_dict(), "settings": vars(settings), "max_gpu_memory": limit,
            "fits": limit is None or plan.total <= limit, "refusal": refusal,
            "chosen_to_fit": [{"key": c.key, "value": c.value, "why": c.line} for c in choices],
            "weight_streaming": stream.as_dict() if stream is not None else None}


def print_plan(console: Console, plan, settings, limit: int | None, refusal: str | None, title: str,
               choices=(), stream=None) -> None:
    """stream: engine.memory.streaming.StreamPlan of a run that streams blocks (which, and the predicted tok/s)."""
    from engine.memory.budget import format_bytes
    table = Table("category", "item", "MiB", "note", title=title)
    for line in plan.lines:
        table.add_row(line.category, line.name, f"{line.bytes / 2**20:,.1f}", line.note)
    table.add_row("", "[bold]total on the device[/bold]", f"[bold]{plan.total / 2**20:,.1f}[/bold]",
                  format_bytes(plan.total))
    console.print(table)
    if plan.host_lines:
        host = Table("category", "item", "MiB", "note", title="in host RAM")
        for line in plan.host_lines:
            host.add_row(line.category, line.name, f"{line.bytes / 2**20:,.1f}", line.note)
        console.print(host)
    s = settings
    console.print(f"[dim]{'cuda' if s.cuda else 'cpu'}: {s.slots} slot(s) × {s.max_seq_len} positions, "
                  f"KV {s.kv_label}, prefill chunk {s.prefill_chunk_size}, "
                  f"embedding in {'host memory' if s.embedding_on_host else 'device memory'}, "
                  + (f"fused step graphed for {s.graph_rows} row count(s)" if not s.kv_offload
                     else f"fused step for {s.graph_rows} row count(s), run eagerly (offloaded KV)")
                  + (" with the streamed blocks' copies (pinned host memory; eager when pinning fails)"
                     if s.weight_offload else "")
                  + "[/dim]")
    for line in stream.lines() if stream is not None else ():
        console.print(f"[cyan]weight streaming: {line}[/cyan]")
    for choice in choices:
        console.print(f"[yellow]chosen to fit max_gpu_memory: {choice.line}[/yellow]")
    if limit is not None:
        if refusal:
            console.print(f"[red]over max_gpu_memory {format_bytes(limit)}: {refusal}[/red]")
        else:
            console.print(f"[green]fits max_gpu_memory {format_bytes(limit)} "
                          f"({format_bytes(limit - plan.total)} to spare)[/green]")
