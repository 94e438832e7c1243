"""`bonsai bench`: llama-bench-style model runs, task suites, and runs against a server."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from bonsai_cli import bench_report
from bonsai_cli.common import (DRAFT_TOKENS_HELP, HOST_KV_MIB_HELP, KV_OFFLOAD_HELP, KV_TYPE_HELP, LOAD_FORMAT_HELP,
                               SPEC_HELP, WEIGHT_DTYPE_HELP, WEIGHTS_HELP, err_console, kv_offload_options,
                               speculative_config)
from bonsai_cli.gpu_budget import EMBEDDING_ON_HOST_HELP, MAX_GPU_MEMORY_HELP
from bonsai_cli.pipeline_options import DEVICE_HELP, PIPELINE_HELP, pipeline_devices


def _int_list(text: str, option: str) -> list[int]:
    from engine.errors import BonsaiError
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BonsaiError(f"{option} takes comma-separated integers like 512,1024 (got '{text}')") from None


def _spec_entry(config) -> dict[str, Any]:
    if config is None:
        return {"active": False, "drafters": []}
    return {"active": True, "method": config.method, "drafters": [d.label for d in config.drafters],
            "num_draft_tokens": config.num_draft_tokens, "adaptive": config.adaptive,
            "ngram": [config.ngram_min, config.ngram_max], "ngram_pool_size": config.ngram_pool_size}


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
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    pipeline_parallel: bool = typer.Option(False, "--pipeline-parallel", help=PIPELINE_HELP),
    weight_dtype: str = typer.Option("auto", "--weight-dtype", help=WEIGHT_DTYPE_HELP),
    weights: str = typer.Option("bf16", "--weights", help=WEIGHTS_HELP),
    group_size: int = typer.Option(128, "--group-size", help="inputs per scale group of packed weights"),
    head_weights: str = typer.Option("bf16", "--head-weights", help="run-time format of the output layer"),
    load_format: str = typer.Option("auto", "--load-format", help=LOAD_FORMAT_HELP),
    max_seq_len: int = typer.Option(0, "--max-seq-len", help="context to allocate (default: what the tests need)"),
    kv_type: str = typer.Option("bf16", "--kv-type", help=KV_TYPE_HELP),
    max_gpu_memory: Optional[str] = typer.Option(None, "--max-gpu-memory", help=MAX_GPU_MEMORY_HELP),
    embedding_on_host: Optional[bool] = typer.Option(None, "--embedding-on-host/--embedding-on-gpu",
                                                     help=EMBEDDING_ON_HOST_HELP),
    kv_offload: bool = typer.Option(False, "--kv-offload", help=KV_OFFLOAD_HELP),
    host_kv_mib: Optional[int] = typer.Option(None, "--host-kv-mib", help=HOST_KV_MIB_HELP),
    spec: Optional[str] = typer.Option(None, "--spec", help=SPEC_HELP),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help=DRAFT_TOKENS_HELP),
    vs_plain: bool = typer.Option(False, "--vs-plain", help="with --spec: also run each prompt plain, just before "
                                  "(interleaved); report the speedup per category and check the outputs are identical"),
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
    if url and model:
        raise BonsaiError("give either MODEL or --url, not both")
    if repetitions < 1:
        raise BonsaiError("-r (repetitions) must be >= 1")
    spec_config = speculative_config(spec, draft_tokens)
    from engine.runtime.kv_cache import kv_type_of
    kv_type_of(kv_type)  # an unknown name fails before loading
    if kv_type != "bf16" and url:
        raise BonsaiError("--kv-type sets a local MODEL's cache; a server sets its own in its config (model.kv_type)")
    if url and max_gpu_memory:
        raise BonsaiError("--max-gpu-memory limits a local MODEL; a server takes memory.max_gpu_memory in its config")
    if url and embedding_on_host is not None:
        raise BonsaiError("--embedding-on-host places a local MODEL's table; a server takes memory.embedding_on_host "
                          "in its config")
    offload = kv_offload_options(kv_offload, host_kv_mib)
    if kv_offload and url:
        raise BonsaiError("--kv-offload measures a local MODEL; a server sets memory.kv_offload in its config")
    if spec_config is not None and url:
        raise BonsaiError("--spec measures a local MODEL; a server sets its own speculation in its config")
    if url and pipeline_parallel:
        raise BonsaiError("--pipeline-parallel runs a local MODEL; a server sets memory.pipeline_parallel in its config")
    devices = None if url else pipeline_devices(device, pipeline_parallel, kv_offload, spec_config)
    if vs_plain and (spec_config is None or not suite):
        raise BonsaiError("--vs-plain compares speculative with plain decoding on a suite: give --spec and --suite "
                          "(for -p/-n tests, run twice and use --compare)")
    report: dict[str, Any] = {"bonsai_bench": bench_report.SCHEMA_VERSION, "complete": False,
                              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                              "speculative": _spec_entry(spec_config),
                              "caches": {"prefix_reuse": False, "fresh_prompts_per_repetition": True}}
    save = (lambda: bench_report.write_json(report, json_out)) if json_out else (lambda: None)
    try:
        if url:
            from bonsai_cli.bench_server import run_server_bench
            run_server_bench(report, url, suite or "short", categories, limit, _int_list(concurrency, "--concurrency"),
                             repetitions, api_key, timeout, save)
        else:
            from bonsai_cli.bench_local import run_local_bench
            load = dict(weight_dtype=weight_dtype, weights=weights, group_size=group_size,
                        head_weights=head_weights, load_format=load_format)
            run_local_bench(report, model, device, load, max_seq_len, kv_type, suite, categories, limit,
                            _int_list(n_prompt, "-p"), _int_list(n_gen, "-n"), _int_list(depth, "-d"),
                            repetitions, combined, save, spec_config, vs_plain, max_gpu_memory, offload,
                            embedding_on_host, pipeline=devices)
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
