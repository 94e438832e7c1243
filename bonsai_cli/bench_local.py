"""`bonsai bench MODEL`: model runs or task suites on the local engine."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Optional

from rich.progress import Progress

from bonsai_cli.common import err_console


def run_local_bench(report: dict[str, Any], model: Optional[str], config_file: Optional[Path],
                    flags: dict[str, Any], suite: Optional[str], categories: Optional[str], limit: Optional[int],
                    n_prompt: list[int], n_gen: list[int], depth: list[int], repetitions: int, combined: bool,
                    save: Callable[[], None], vs_plain: bool = False) -> None:
    """MODEL (or --config) with the run flags, as `bonsai generate` builds it; the context is what the
    tests need unless --max-seq-len (or the config) says."""
    from bonsai_cli.run_options import open_cli_run, run_config
    from engine.bench import model_bench
    from engine.bench.suites import load_suite

    prompts = None
    if suite:
        prompts = load_suite(suite, categories.split(",") if categories else None, limit)
        tests = []
    else:
        tests = model_bench.plan_tests(n_prompt, n_gen, depth, combined)
    needed = max((t.depth + t.n_prompt + t.n_gen + 2 for t in tests), default=2048)
    cfg = run_config(model, flags, config_file)
    if flags.get("--max-seq-len") is None and cfg.runtime.max_seq_len is None and cfg.model.max_context is None:
        cfg = run_config(model, {**flags, "--max-seq-len": needed}, config_file)
    report["speculative"] = _spec_entry(cfg.spec_config)
    with contextlib.closing(open_cli_run(cfg, auto_pull=model is None and config_file is None,
                                         from_flags=config_file is None)) as run:
        if run.pipeline is not None:
            report["pipeline"] = run.pipeline.as_dict()
        _bench_runner(report, run, tests, prompts, suite, repetitions, save, vs_plain)


def _spec_entry(config) -> dict[str, Any]:
    if config is None:
        return {"active": False, "drafters": []}
    return {"active": True, "method": config.method, "drafters": [d.label for d in config.drafters],
            "num_draft_tokens": config.num_draft_tokens, "adaptive": config.adaptive,
            "ngram": [config.ngram_min, config.ngram_max], "ngram_pool_size": config.ngram_pool_size}



def _bench_runner(report, run, tests, prompts, suite, repetitions, save, vs_plain) -> None:
    """The bench of an open run (one device, or a pipeline: stage 0's device and plan)."""
    from engine.bench.environment import describe_environment
    from engine.memory.limit import check_usage, within_limit
    loaded, runner, budget = run.loaded, run.runner, run.plan
    check_usage(budget.limit, loaded.device, "loading", budget.plan.total)
    report["memory"] = memory_report(budget, loaded.device)
    report["environment"] = describe_environment(loaded.device)
    report["model"] = {
        "name": loaded.path.name, "path": str(loaded.path), "architecture": loaded.config.architecture,
        "parameters": loaded.summary.num_parameters, "file_bytes": loaded.summary.file_bytes,
        "bits_per_weight": loaded.summary.bits_per_weight, "dtype": str(loaded.dtype).replace("torch.", ""),
        "weight_dtype": str(loaded.weight_dtype).replace("torch.", ""), "int4_layers": loaded.int4_layers,
        "cpu_kernels": loaded.cpu_kernels, "cpu_body": _cpu_body(loaded.cpu_kernels),
        "output_layer": _output_layer(loaded.model),
        "weights": loaded.weight_format.quant_type, "head_weights": loaded.weight_format.head_type,
        "group_size": loaded.weight_format.group_size, "load_format": loaded.summary.format,
        "ternary_layout": loaded.weight_format.ternary_layout,
        "sensitive_layers": list(loaded.weight_format.sensitive_layers),
        "sensitive_type": loaded.weight_format.sensitive_type,
        "kv_dtype": str(runner.cache.dtype).replace("torch.", ""), "kv_type": runner.cache.kv_type.name,
        "kv_bytes": runner.cache.nbytes, "max_seq_len": runner.max_seq_len,
        "embedding_on_host": budget.settings.embedding_on_host}
    report["settings"] = {"repetitions": repetitions, "device": str(loaded.device), "temperature": 0.0,
                          "fused_decode": runner.decoder is not None,
                          "cuda_graph": getattr(runner.decoder, "graph", None) is not None,
                          "kv_offload": runner.cache.streamed, "prefill_chunk_size": runner.prefill_chunk_size,
                          "pipeline_stages": len(getattr(runner, "stages", ())) or 1,
                          "decode_gemv": _decode_gemv(loaded, runner), "decode_attention": _decode_attention(runner)}
    save()
    try:
        with within_limit(budget.limit, "benchmarking"):
            _run_tests(report, run, tests, prompts, suite, repetitions, save, vs_plain,
                       _copy_megabytes(budget.limit, loaded.device))
    finally:  # the allocator's peak over the whole run, next to the plan
        report["memory"] = memory_report(budget, loaded.device)
        save()


def _output_layer(model) -> str:
    """How the CPU output layer runs: "int8" / "float16" (one fast GEMM, top logits exact), "as stored" (the native
    kernels, top logits exact) or "" (as loaded)."""
    from engine.runtime.cpu_kquant import KQuantHead
    from engine.runtime.narrow_head import Int8Head, NarrowHead
    head = model.lm_head
    if isinstance(head, KQuantHead):
        return "as stored"
    return "int8" if isinstance(head, Int8Head) else "float16" if isinstance(head, NarrowHead) else ""


def _cpu_body(kernels: str) -> str | None:
    """The native CPU kernels' vector body ("avx512-vnni", "avx2"; "portable" for the plain C loops), None when
    they do not run."""
    if kernels != "native":
        return None
    from quant.kernels import cpu_rt
    return cpu_rt.body() or "portable"


def _decode_gemv(loaded, runner) -> dict[str, str]:
    """The one-row kernel of each packed matrix shape, where the CUDA decode step runs them ({} elsewhere)."""
    if loaded.device.type != "cuda" or runner.decoder is None or not runner.decoder.ops.fast:
        return {}
    from engine.weights.packed_linear import decode_paths
    return decode_paths(loaded.model)


def _decode_attention(runner) -> str:
    """How a one-row CUDA decode step runs attention: "cuda rope+attention, N splits" (one launch a layer,
    engine.kernels.cuda_attention; ", combined in o_proj" where o_proj's product combines the splits), "triton"
    (rope / KV write, split attention, combine), or "" (no fused step)."""
    decoder = runner.decoder
    if decoder is None or not decoder.ops.fast or decoder.workspace is None:
        return ""
    buffers = decoder.workspace.attention
    if buffers is None:
        return "triton"
    return f"cuda rope+attention, {buffers.splits} splits" + ("" if buffers.combine else ", combined in o_proj")


def memory_report(budget, device) -> dict[str, Any]:
    """Planned bytes (engine.run.plan.RunPlan) against the allocator's peaks (the report's 'memory' entry)."""
    import torch

    from engine.memory.limit import usage
    cuda = torch.device(device).type == "cuda"
    used = usage(device)
    return {"planned_bytes": budget.plan.total, "planned_by_category": budget.plan.categories(),
            "max_gpu_memory": budget.limit, "chosen_to_fit": {c.key: c.value for c in budget.choices},
            "embedding_on_host": budget.settings.embedding_on_host,
            "prefill_chunk_size": budget.settings.prefill_chunk_size,
            "peak_allocated_bytes": used["peak_allocated"] if cuda else None,  # no allocator statistics on the CPU
            "peak_reserved_bytes": used["peak_reserved"] if cuda else None,
            # weight offload: the streamed blocks and the decode speed their PCIe bound predicts (engine.memory.streaming)
            "weight_streaming": budget.stream.as_dict() if budget.stream is not None else None}


def _copy_megabytes(limit: int | None, device) -> int:
    """The copy-bandwidth buffers' size under a memory limit: a quarter of what the limit leaves each
    (two buffers), at most the default 1 GiB; 0 (the default size) without a limit."""
    if limit is None or device.type != "cuda":
        return 0
    import torch
    left = limit - torch.cuda.memory_reserved(device)
    return max(16, min(1024, left // 4 // 2**20))


def _run_tests(report, run, tests, prompts, suite, repetitions, save, vs_plain, copy_megabytes: int = 0) -> None:
    from engine.bench import model_bench
    loaded, runner = run.loaded, run.runner
    engine = run.engine()  # with the config's drafters, if any
    if prompts is not None:
        run.require_tokenizer()  # a generated model's borrowed one (model.tokenizer) counts
        plain = run.engine(speculative=False) if vs_plain else None
        _run_suite(report, "suite", engine, suite, prompts, repetitions, save, plain)
        if vs_plain:
            _add_speedup(report)
            save()
        return
    copy_bw = model_bench.measure_copy_bandwidth(loaded.device, copy_megabytes)
    report["bandwidth"] = {"copy_bytes_per_second": copy_bw}
    report["tests"] = []
    special = loaded.tokenizer.special_ids if loaded.tokenizer is not None else frozenset()
    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task("benchmark", total=len(tests) * repetitions)
        for test in tests:
            progress.update(task, description=test.name)
            [m] = model_bench.run_model_bench(engine, [test], repetitions, special,
                                              on_sample=lambda t, r, s: progress.advance(task))
            entry = m.summary()
            # rank 0 of a pipeline holds stage 0's part only: no whole-model byte count; with drafts, tokens
            # per pass vary
            if test.n_gen and not test.n_prompt and engine.spec is None and run.pipeline is None:
                bytes_per_token = model_bench.decode_bytes_per_token(runner, test.depth + test.n_gen // 2)
                achieved = bytes_per_token * entry["tokens_per_second"]
                entry["decode_bandwidth"] = {"bytes_per_token": bytes_per_token, "achieved_gb_per_s": achieved / 1e9,
                                             "fraction_of_copy": achieved / copy_bw,
                                             "ceiling_tokens_per_second": copy_bw / bytes_per_token}
            if test.n_gen and not test.n_prompt and runner.cache.streamed:  # the KV rows cross PCIe every step
                entry["kv_offload"] = {"host_to_device_bytes_per_token":
                                       runner.cache.transfer_bytes(test.depth + test.n_gen // 2)}
            report["tests"].append(entry)
            save()


def _run_suite(report, key, engine, name, prompts, repetitions, save, plain=None) -> None:
    """The suite into report[key]; with `plain` (an engine without drafters), plain runs interleaved
    into report['plain_suite']."""
    from engine.bench import suite_runner

    keys = [key] + (["plain_suite"] if plain is not None else [])
    entries = {k: {"name": name, "prompts": len(prompts), "results": [], "by_category": {}} for k in keys}
    report.update(entries)
    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task(f"suite {name}", total=len(prompts) * repetitions * len(keys))
        done: dict[str, list] = {k: [] for k in keys}

        def recorder(k: str):
            def on_result(result) -> None:
                done[k].append(result)
                entries[k]["results"].append(result.as_dict())
                entries[k]["by_category"] = suite_runner.summarize_by_category(done[k])
                progress.update(task, advance=1, description=f"{result.category} {result.decode_tokens_per_second:.1f} tok/s"
                                + (" (plain)" if k == "plain_suite" else ""))
                save()
            return on_result

        suite_runner.run_suite(engine, prompts, repetitions, on_result=recorder(key), plain=plain,
                               on_plain_result=recorder("plain_suite") if plain is not None else None)


def _add_speedup(report: dict[str, Any]) -> None:
    """Per category: speculative decode tok/s over plain; and whether every greedy output matched."""
    from bonsai_cli.bench_report import output_mismatches
    plain, spec = report["plain_suite"]["by_category"], report["suite"]["by_category"]
    report["suite"]["speedup"] = {cat: spec[cat]["decode_tokens_per_second"] / plain[cat]["decode_tokens_per_second"]
                                  for cat in spec if plain.get(cat, {}).get("decode_tokens_per_second")}
    compared, mismatches = output_mismatches({**report, "suite": report["plain_suite"]}, report)
    report["suite"]["outputs_compared"] = compared
    report["suite"]["output_mismatches"] = mismatches
