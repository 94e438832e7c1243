"""`bonsai generate MODEL --prompt TEXT`."""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

import typer

from bonsai_cli.common import (DRAFT_TOKENS_HELP, HOST_KV_MIB_HELP, KV_OFFLOAD_HELP, KV_TYPE_HELP, SPEC_HELP,
                               WEIGHT_DTYPE_HELP, err_console, kv_offload_options, load_for_cli, print_choices,
                               print_json, spec_summary, speculative_config)
from bonsai_cli.gpu_budget import EMBEDDING_ON_HOST_HELP, MAX_GPU_MEMORY_HELP, plan_cli_run
from bonsai_cli.pipeline_options import DEVICE_HELP, PIPELINE_HELP, open_cli_pipeline, pipeline_devices


def sampling_from_options(temperature: float, top_p: float, top_k: int, min_p: float,
                          repeat_penalty: float, presence_penalty: float, frequency_penalty: float,
                          seed: Optional[int]):
    from engine.decoding.sampling import SamplingParams
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                          repetition_penalty=repeat_penalty, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, seed=seed)


def generate(
    model: str = typer.Argument(..., help="a .gguf file, a model directory or a pulled name"),
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
    device: str = typer.Option("cpu", "--device", help=DEVICE_HELP),
    pipeline_parallel: bool = typer.Option(False, "--pipeline-parallel", help=PIPELINE_HELP),
    weight_dtype: str = typer.Option("auto", "--weight-dtype", help=WEIGHT_DTYPE_HELP),
    max_seq_len: int = typer.Option(4096, "--max-seq-len", help="context length to allocate"),
    kv_type: str = typer.Option("bf16", "--kv-type", help=KV_TYPE_HELP),
    kv_offload: bool = typer.Option(False, "--kv-offload", help=KV_OFFLOAD_HELP),
    host_kv_mib: Optional[int] = typer.Option(None, "--host-kv-mib", help=HOST_KV_MIB_HELP),
    spec: Optional[str] = typer.Option(None, "--spec", help=SPEC_HELP),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help=DRAFT_TOKENS_HELP),
    max_gpu_memory: Optional[str] = typer.Option(None, "--max-gpu-memory", help=MAX_GPU_MEMORY_HELP),
    embedding_on_host: Optional[bool] = typer.Option(None, "--embedding-on-host/--embedding-on-gpu",
                                                     help=EMBEDDING_ON_HOST_HELP),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object on stdout"),
) -> None:
    """Generate a continuation (or a chat answer with --chat), streamed to stdout."""
    from engine.errors import BonsaiError
    from engine.decoding.generate import GenerationRequest
    from engine.runtime.kv_cache import kv_type_of
    from engine.memory.limit import within_limit
    from engine.runtime.runner import ModelRunner

    if prompt == "-":
        prompt = sys.stdin.read()
    if system and not chat:
        raise BonsaiError("--system needs --chat (a system message only exists in a chat template)")
    request = GenerationRequest(max_tokens=max_tokens, stop=tuple(stop), sampling=sampling_from_options(
        temperature, top_p, top_k, min_p, repeat_penalty, presence_penalty, frequency_penalty, seed))
    spec_config = speculative_config(spec, draft_tokens)
    kv_type_of(kv_type)  # an unknown name fails before loading
    offload = kv_offload_options(kv_offload, host_kv_mib)
    devices = pipeline_devices(device, pipeline_parallel, kv_offload, spec_config)
    runner = None
    chunk = 512
    if devices is not None:  # one process per device; this one runs stage 0 and the generation
        if embedding_on_host:
            raise BonsaiError("--embedding-on-host is not available with --pipeline-parallel; remove it")
        runner, budget, _ = open_cli_pipeline(model, devices, max_seq_len, max_gpu_memory,
                                              {"weight_dtype": weight_dtype}, kv_type, quiet=json_out)
        loaded, limit = runner.loaded, budget.limit
    else:
        budget = plan_cli_run(model, device, max_seq_len, max_gpu_memory, weight_dtype=weight_dtype,
                              spec_config=spec_config, kv_type=kv_type, kv_offload=kv_offload,
                              embedding_on_host=embedding_on_host) if max_gpu_memory else None
        limit = budget.limit if budget else None
        on_host = budget.settings.embedding_on_host if budget else bool(embedding_on_host)
        chunk = budget.settings.prefill_chunk_size if budget else 512
        if budget and not json_out:
            print_choices(budget)
        with within_limit(limit, "loading the model"):
            loaded = load_for_cli(model, device, quiet=json_out, weight_dtype=weight_dtype, embedding_on_host=on_host)
    with contextlib.closing(runner) if runner is not None else contextlib.nullcontext():  # a pipeline's workers end
        _generate(loaded, runner, prompt_ids(loaded, prompt, chat, system), request, spec_config,
                  lambda: ModelRunner(loaded, max_seq_len=max_seq_len, kv_type=kv_type, prefill_chunk_size=chunk,
                                      prefill_graphs=limit is None, **offload), max_seq_len, budget, json_out)


def prompt_ids(loaded, prompt: str, chat: bool, system: Optional[str]) -> list[int]:
    """The prompt's token ids, through the chat template with --chat."""
    tok = loaded.require_tokenizer()
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    return tok.encode(prompt, add_special_tokens=True)


def _generate(loaded, runner, ids: list[int], request, spec_config, make_runner, max_seq_len: int, budget,
              json_out: bool) -> None:
    """Stream the generation (runner: a started pipeline, or None: make_runner() makes one)."""
    from engine.decoding.generate import stream_generate
    from engine.memory.limit import check_usage, within_limit
    from engine.speculative.config import build_drafter

    tok, limit = loaded.tokenizer, budget.limit if budget else None
    with within_limit(limit, "allocating the KV cache and the drafter"):
        runner = runner or make_runner()
        drafter = build_drafter(spec_config, loaded, max_seq_len) if spec_config else None
    check_usage(limit, loaded.device, "loading", budget.plan.total if budget else None)
    pieces, token_ids, finish, stats = [], [], "length", None
    with within_limit(limit, "generating"):
        for event in stream_generate(runner, tok, ids, request, drafter=drafter,
                                     num_draft_tokens=spec_config.num_draft_tokens if spec_config else 0):
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
