"""`bonsai bench`: llama-bench-style model runs, task suites, and runs against a server."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from bonsai_cli import bench_report
from bonsai_cli.common import err_console
from bonsai_cli.run_options import (CONFIG_HELP, DEVICE_HELP, DRAFT_TOKENS_HELP, EMBEDDING_ON_HOST_HELP,
                                    HOST_KV_MIB_HELP, KV_OFFLOAD_HELP, KV_TYPE_HELP, LOAD_FORMAT_HELP,
                                    MAX_GPU_MEMORY_HELP, PIPELINE_HELP, SPEC_HELP, WEIGHT_DTYPE_HELP, WEIGHTS_HELP,
                                    CPU_INT4_HELP, CPU_KERNELS_HELP, OUTPUT_DTYPE_HELP)


def _int_list(text: str, option: str) -> list[int]:
    from engine.errors import BonsaiError
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BonsaiError(f"{option} takes comma-separated integers like 512,1024 (got '{text}')") from None


def bench(
    model: Optional[str] = typer.Argument(None, help="model path or pulled name (default: smollm2-135m)"),
    url: Optional[str] = typer.Option(None, "--url", help="measure an OpenAI-compatible server instead"),
    n_prompt: str = typer.Option("512", "-p", "--n-prompt", help="prompt lengths, e.g. 512,1024"),
    n_gen: str = typer.Option("128", "-n", "--n-gen", help="generation lengths, e.g. 128"),
    depth: str = typer.Option("0", "-d", "--depth", help="context already in the KV cache, e.g. 0,4096"),
    repetitions: int = typer.Option(5, "-r", "--repetitions", help="timed runs per test (after a warm-up)"),
    combined: bool = typer.Option(True, "--pg/--no-pg", help="also run pp+tg together"),
    suite: Optional[str] = typer.Option(None, "--suite", help="task suite name (short, full) or a JSON file"),
    categories: Optional[str] = typer.Option(None, "--categories", help="only these suite categories (comma list)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="at most this many prompts per category"),
    concurrency: str = typer.Option("1", "--concurrency", help="with --url: requests in flight, e.g. 1,2,4,8"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="BONSAI_API_KEY", help="with --url"),
    timeout: float = typer.Option(300.0, "--timeout", help="with --url: seconds per request"),
    config: Optional[Path] = typer.Option(None, "--config", help=CONFIG_HELP),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    pipeline_parallel: bool = typer.Option(False, "--pipeline-parallel", help=PIPELINE_HELP),
    weight_dtype: Optional[str] = typer.Option(None, "--weight-dtype", help=WEIGHT_DTYPE_HELP + " (default auto)"),
    cpu_int4: Optional[bool] = typer.Option(None, "--cpu-int4/--no-cpu-int4", help=CPU_INT4_HELP),
    cpu_kernels: Optional[str] = typer.Option(None, "--cpu-kernels", help=CPU_KERNELS_HELP),
    output_dtype: Optional[str] = typer.Option(None, "--output-dtype", help=OUTPUT_DTYPE_HELP),
    weights: Optional[str] = typer.Option(None, "--weights", help=WEIGHTS_HELP + " (default bf16)"),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="inputs per scale group of packed weights "
                                             "(default 128)"),
    head_weights: Optional[str] = typer.Option(None, "--head-weights", help="run-time format of the output layer "
                                               "(default bf16)"),
    load_format: Optional[str] = typer.Option(None, "--load-format", help=LOAD_FORMAT_HELP + " (default auto)"),
    ternary_layout: Optional[str] = typer.Option(None, "--ternary-layout", help="ternary matrices' layout: 2bit, "
                                                 "base3 (17.6% fewer bytes) or auto (base3 when 2bit does not fit "
                                                 "--max-gpu-memory resident; default)"),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="context to allocate (default: what the "
                                              "tests need)"),
    kv_type: Optional[str] = typer.Option(None, "--kv-type", help=KV_TYPE_HELP + " (default bf16)"),
    max_gpu_memory: Optional[str] = typer.Option(None, "--max-gpu-memory", help=MAX_GPU_MEMORY_HELP),
    embedding_on_host: Optional[bool] = typer.Option(None, "--embedding-on-host/--embedding-on-gpu",
                                                     help=EMBEDDING_ON_HOST_HELP),
    kv_offload: bool = typer.Option(False, "--kv-offload", help=KV_OFFLOAD_HELP),
    host_kv_mib: Optional[int] = typer.Option(None, "--host-kv-mib", help=HOST_KV_MIB_HELP),
    spec: Optional[str] = typer.Option(None, "--spec", help=SPEC_HELP),
    draft_tokens: Optional[int] = typer.Option(None, "--draft-tokens", help=DRAFT_TOKENS_HELP + " (default 4)"),
    vs_plain: bool = typer.Option(False, "--vs-plain", help="with --spec: also run each prompt plain, just before "
                                  "(interleaved); report the speedup per category and check the outputs are identical; "
                                  "with --url: each level also with drafting off per request (speculative.n_max 0)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write every result and the environment here"),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="write a PNG chart here"),
    compare: Optional[list[Path]] = typer.Option(None, "--compare", help="two JSON files: print B/A ratios"),
) -> None:
    """Measure speed: prefill/decode tok/s with bandwidth use, task suites (TTFT, tok/s by category),
    or any OpenAI-compatible server (--url) at several concurrency levels."""
    from engine.errors import BonsaiError

    console = Console()
    if compare:
        if len(compare) != 2:
            raise BonsaiError("--compare takes exactly two JSON files: --compare A.json --compare B.json")
        a, b = (bench_report.load_report(p) for p in compare)
        compared, mismatches = bench_report.output_mismatches(a, b)
        if compared == 0 or len(mismatches) < compared:
            console.print(bench_report.compare_table(a, b, compare[0].name, compare[1].name))
        if compared:
            for line in mismatches:
                err_console.print(f"[red]mismatch: {line}[/red]")
            if mismatches:
                raise BonsaiError(f"{len(mismatches)} of {compared} greedy outputs differ between "
                                  f"{compare[0].name} and {compare[1].name}: the runs are not equivalent")
            err_console.print(f"[green]all {compared} greedy outputs are identical[/green]")
        return
    if url and (model or config):
        raise BonsaiError("give either MODEL (or --config) or --url, not both")
    if repetitions < 1:
        raise BonsaiError("-r (repetitions) must be >= 1")
    local = {"--device": device, "--pipeline-parallel": pipeline_parallel, "--weight-dtype": weight_dtype,
             "--cpu-int4": cpu_int4, "--cpu-kernels": cpu_kernels, "--output-dtype": output_dtype,
             "--weights": weights, "--group-size": group_size, "--head-weights": head_weights,
             "--load-format": load_format, "--ternary-layout": ternary_layout, "--max-seq-len": max_seq_len,
             "--kv-type": kv_type,
             "--max-gpu-memory": max_gpu_memory, "--embedding-on-host": embedding_on_host, "--kv-offload": kv_offload,
             "--host-kv-mib": host_kv_mib, "--spec": spec, "--draft-tokens": draft_tokens}
    if url:
        given = [flag for flag, value in local.items() if value not in (None, False)]
        if given:
            raise BonsaiError(f"{given[0]} sets how a local MODEL runs; a server sets its own in its config")
    if vs_plain and not url and (spec is None or not suite):
        raise BonsaiError("--vs-plain compares speculative with plain decoding on a suite: give --spec and --suite "
                          "(for -p/-n tests, run twice and use --compare; with --url the server's speculation)")
    report: dict[str, Any] = {"bonsai_bench": bench_report.SCHEMA_VERSION, "complete": False,
                              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "speculative": {"active": False, "drafters": []},
                              "caches": {"prefix_reuse": False, "fresh_prompts_per_repetition": True}}
    save = (lambda: bench_report.write_json(report, json_out)) if json_out else (lambda: None)
    try:
        if url:
            from bonsai_cli.bench_server import run_server_bench
            run_server_bench(report, url, suite or "short", categories, limit, _int_list(concurrency, "--concurrency"),
                             repetitions, api_key, timeout, save, vs_plain)
        else:
            from bonsai_cli.bench_local import run_local_bench
            run_local_bench(report, model, config, local, suite, categories, limit, _int_list(n_prompt, "-p"),
                            _int_list(n_gen, "-n"), _int_list(depth, "-d"), repetitions, combined, save, vs_plain)
        report["complete"] = True
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted: keeping the results measured so far[/yellow]")
    finally:
        save()
    if "model" in report:
        bench_report.print_report(report, console)
    if json_out:
        err_console.print(f"[dim]results written to {json_out}[/dim]")
    if plot_out and "model" in report:
        bench_report.plot(report, plot_out)
        err_console.print(f"[dim]plot written to {plot_out}[/dim]")
    if not report["complete"]:
        raise typer.Exit(130)
