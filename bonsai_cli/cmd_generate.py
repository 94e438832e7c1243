"""`bonsai generate MODEL --prompt TEXT`."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from bonsai_cli.common import err_console, print_json, spec_summary
from bonsai_cli.run_options import (CONFIG_HELP, DEVICE_HELP, DRAFT_TOKENS_HELP, EMBEDDING_ON_HOST_HELP,
                                    HOST_KV_MIB_HELP, KV_OFFLOAD_HELP, KV_TYPE_HELP, MAX_GPU_MEMORY_HELP,
                                    PIPELINE_HELP, SPEC_HELP, WEIGHT_DTYPE_HELP,
                                    CPU_INT4_HELP, CPU_KERNELS_HELP, OUTPUT_DTYPE_HELP, open_cli_run, run_config)


def sampling_from_options(temperature: float, top_p: float, top_k: int, min_p: float,
                          repeat_penalty: float, presence_penalty: float, frequency_penalty: float,
                          seed: Optional[int]):
    from engine.decoding.sampling import SamplingParams
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          repetition_penalty=repeat_penalty, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, seed=seed)


def generate(
    model: Optional[str] = typer.Argument(None, help="a .gguf file, a model directory or a pulled name "
                                          "(or --config)"),
    prompt: str = typer.Option(..., "--prompt", "-p", help="the prompt text ('-' reads standard input)"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the model's chat template"),
    system: Optional[str] = typer.Option(None, "--system", help="system message (with --chat)"),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="tokens to generate at most"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 disables"),
    min_p: float = typer.Option(0.0, "--min-p"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty"),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty"),
    seed: Optional[int] = typer.Option(None, "--seed", help="same seed → same output"),
    stop: list[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
    config: Optional[Path] = typer.Option(None, "--config", help=CONFIG_HELP),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    pipeline_parallel: bool = typer.Option(False, "--pipeline-parallel", help=PIPELINE_HELP),
    weight_dtype: Optional[str] = typer.Option(None, "--weight-dtype", help=WEIGHT_DTYPE_HELP + " (default auto)"),
    cpu_int4: Optional[bool] = typer.Option(None, "--cpu-int4/--no-cpu-int4", help=CPU_INT4_HELP),
    cpu_kernels: Optional[str] = typer.Option(None, "--cpu-kernels", help=CPU_KERNELS_HELP),
    output_dtype: Optional[str] = typer.Option(None, "--output-dtype", help=OUTPUT_DTYPE_HELP),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="context length to allocate "
                                              "(default 4096, or the model's positions if fewer)"),
    kv_type: Optional[str] = typer.Option(None, "--kv-type", help=KV_TYPE_HELP + " (default bf16)"),
    kv_offload: bool = typer.Option(False, "--kv-offload", help=KV_OFFLOAD_HELP),
    host_kv_mib: Optional[int] = typer.Option(None, "--host-kv-mib", help=HOST_KV_MIB_HELP),
    spec: Optional[str] = typer.Option(None, "--spec", help=SPEC_HELP),
    draft_tokens: Optional[int] = typer.Option(None, "--draft-tokens", help=DRAFT_TOKENS_HELP + " (default 4)"),
    max_gpu_memory: Optional[str] = typer.Option(None, "--max-gpu-memory", help=MAX_GPU_MEMORY_HELP),
    embedding_on_host: Optional[bool] = typer.Option(None, "--embedding-on-host/--embedding-on-gpu",
                                                     help=EMBEDDING_ON_HOST_HELP),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object on stdout"),
) -> None:
    """Generate a continuation (or a chat answer with --chat), streamed to stdout."""
    import contextlib

    from engine.errors import BonsaiError

    if model is None and config is None:
        raise BonsaiError("bonsai generate needs MODEL (or --config serve.yaml)")
    if prompt == "-":
        prompt = sys.stdin.read()
    if system and not chat:
        raise BonsaiError("--system needs --chat (a system message only exists in a chat template)")
    sampling = sampling_from_options(temperature, top_p, top_k, min_p, repeat_penalty, presence_penalty,
                                     frequency_penalty, seed)
    cfg = run_config(model, {"--device": device, "--pipeline-parallel": pipeline_parallel,
                             "--weight-dtype": weight_dtype,
                             "--cpu-int4": cpu_int4, "--cpu-kernels": cpu_kernels, "--output-dtype": output_dtype, "--max-seq-len": max_seq_len, "--kv-type": kv_type,
                             "--kv-offload": kv_offload, "--host-kv-mib": host_kv_mib, "--spec": spec,
                             "--draft-tokens": draft_tokens, "--max-gpu-memory": max_gpu_memory,
                             "--embedding-on-host": embedding_on_host}, config)
    with contextlib.closing(open_cli_run(cfg, quiet=json_out, from_flags=config is None)) as run:
        _generate(run, prompt_ids(run, prompt, chat, system), max_tokens, sampling, tuple(stop), json_out)


def prompt_ids(run, prompt: str, chat: bool, system: Optional[str]) -> list[int]:
    """The prompt's token ids, through the chat template with --chat."""
    tok = run.require_tokenizer()
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    return tok.encode(prompt, add_special_tokens=True)


def _generate(run, ids: list[int], max_tokens: int, sampling, stop: tuple[str, ...], json_out: bool) -> None:
    """Stream the generation to stdout (or one JSON object at the end)."""
    from engine.decoding.generate import generate
    from engine.decoding.sequence import Request
    from engine.memory.limit import within_limit

    engine = run.engine()
    request = Request(ids, max_tokens=max_tokens, sampling=sampling, stop=stop, split_reasoning=False)
    pieces, token_ids, finish, stats = [], [], "length", None
    with within_limit(run.plan.limit, "generating"):
        for event in generate(engine, request):
            pieces.append(event.text)
            token_ids.extend(event.token_ids)
            stats = event.stats
            finish = event.finish_reason or finish
            if not json_out:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    if json_out:
        print_json({"text": "".join(pieces), "token_ids": token_ids, "prompt_tokens": len(ids),
                    "finish_reason": finish, "timings": stats.as_dict()})
        return
    sys.stdout.write("\n")
    err_console.print(f"[dim]{stats.prompt_tokens} prompt tokens at {stats.prefill_tokens_per_second:.1f} tok/s, "
                      f"{stats.generated_tokens} generated at {stats.decode_tokens_per_second:.1f} tok/s "
                      f"(finish: {finish})[/dim]")
    if stats.speculative is not None:
        err_console.print(f"[dim]{spec_summary(stats.speculative)}[/dim]")
