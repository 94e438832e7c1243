"""`bonsai eval MODEL --ref REF`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from bonsai_cli.common import err_console, print_json
from bonsai_cli.run_options import CPU_INT4_HELP, CPU_KERNELS_HELP, OUTPUT_DTYPE_HELP, WEIGHT_DTYPE_HELP, open_cli_run, run_config


def eval_command(
    model: str = typer.Argument(..., help="the model to judge (path or pulled name)"),
    ref: str = typer.Option(..., "--ref", help="the reference model (e.g. the unquantized source)"),
    text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text to score (default: Python's pydoc topics)"),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="score at most this many tokens of the text"),
    context: int = typer.Option(512, "--context", help="tokens per window"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]"),
    weight_dtype: str = typer.Option("float32", "--weight-dtype", help=WEIGHT_DTYPE_HELP),
    ref_weight_dtype: str = typer.Option("float32", "--ref-weight-dtype", help="the same, for the reference"),
    cpu_int4: bool = typer.Option(False, "--cpu-int4/--no-cpu-int4", help=CPU_INT4_HELP + " (default off here: "
                                  "the judged model's matrices exact as --weight-dtype says)"),
    cpu_kernels: str = typer.Option("auto", "--cpu-kernels", help=CPU_KERNELS_HELP),
    output_dtype: str = typer.Option("float32", "--output-dtype", help=OUTPUT_DTYPE_HELP),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object on stdout"),
) -> None:
    """Perplexity, KL divergence (mean, p99, max) and same-top-token rate of MODEL against REF."""
    from rich.console import Console
    from rich.table import Table

    from engine.errors import BonsaiError
    from engine.quantization.evaluate import check_same_tokenizer, evaluate, read_eval_text

    if max_tokens < 2:
        raise BonsaiError("--max-tokens must be at least 2")
    source_text = read_eval_text(text)
    runners = []
    for spec, wdtype, int4, head in ((model, weight_dtype, cpu_int4, output_dtype),
                                     (ref, ref_weight_dtype, False, "float32")):
        cfg = run_config(spec, {"--device": device, "--weight-dtype": wdtype, "--max-seq-len": context,
                                "--cpu-int4": int4, "--cpu-kernels": cpu_kernels, "--output-dtype": head})
        runners.append(open_cli_run(cfg, quiet=json_out).runner)
    ours, reference = runners
    check_same_tokenizer(ours, reference, source_text[:2000])
    ids = ours.loaded.tokenizer.encode(source_text)[:max_tokens]
    with err_console.status("scoring") as status:
        result = evaluate(ours, reference, ids, context,
                          on_window=lambda done, total: status.update(f"scoring window {done}/{total}"))
    summary = {**result.as_dict(), "model": model, "reference": ref,
               "bits_per_weight": ours.loaded.summary.bits_per_weight,
               "reference_bits_per_weight": reference.loaded.summary.bits_per_weight,
               "text": str(text) if text else "pydoc_data.topics", "context": context}
    if json_out:
        print_json(summary)
        return
    table = Table(title=f"{model} vs {ref} · {result.tokens} tokens scored")
    for col in ("bpw", "ppl", "ref ppl", "mean KLD", "p99 KLD", "max KLD", "same top"):
        table.add_column(col, justify="right")
    table.add_row(f"{summary['bits_per_weight']:.3f}", f"{result.perplexity:.3f}", f"{result.reference_perplexity:.3f}",
                  f"{result.kl_mean:.5f}", f"{result.kl_p99:.5f}", f"{result.kl_max:.5f}", f"{100 * result.same_top:.2f}%")
    Console().print(table)
