"""`bonsai train-drafter MODEL --kind mtp|dflash --out DIR`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from bonsai_cli.common import err_console, print_json
from bonsai_cli.run_options import load_cli_model, run_config


def train_drafter(
    model: str = typer.Argument(..., help="the target model (path or pulled name); it stays frozen"),
    kind: str = typer.Option(..., "--kind", help="mtp (chained multi-token head) or dflash (block drafter)"),
    out: Path = typer.Option(..., "--out", help="directory for drafter.safetensors, checkpoints and the data"),
    data: str = typer.Option("self", "--data", help="'self' (the model's own outputs on built-in prompts) or a UTF-8 text file"),
    steps: int = typer.Option(1000, "--steps", help="total optimizer steps (a resumed run continues up to this)"),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="most tokens per draft: MTP chained depth (default 3), DFlash block (default 8)"),
    lr: float = typer.Option(1e-3, "--lr", help="peak learning rate (warm-up, then cosine to 10%)"),
    batch: int = typer.Option(8, "--batch", help="sequences per step"),
    seq_len: int = typer.Option(128, "--seq-len", help="tokens per training sequence (prompt included)"),
    samples: Optional[int] = typer.Option(None, "--samples", help="sequences to train on: generated with --data self "
                                          "(default 64), at most this many windows of a text file (default all)"),
    loss: str = typer.Option("kl", "--loss", help="kl (to the target's top-16 distribution) or ce (to its argmax)"),
    train_vocab: str = typer.Option("data", "--train-vocab", help="data (output rows the data can ask for; fast) or full"),
    layers: Optional[int] = typer.Option(None, "--layers", help="drafter blocks (default MTP 1, DFlash 2)"),
    intermediate_size: Optional[int] = typer.Option(None, "--intermediate-size", help="drafter FFN width (default half the model's)"),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", help="steps between checkpoints"),
    eval_tokens: int = typer.Option(64, "--eval-tokens", help="tokens generated per held-out prompt for the acceptance figure"),
    resume: bool = typer.Option(False, "--resume", help="continue the training in --out from its last checkpoint"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]"),
    weight_dtype: str = typer.Option("auto", "--weight-dtype",
                                     help="auto: float32 on the CPU (training and verification run several rows "
                                          "per pass, where float16 matrices are widened on every call), the "
                                          "compute dtype on a GPU; or float32 | float16 | bfloat16"),
    baseline: bool = typer.Option(False, "--baseline", help="also measure an untrained drafter's acceptance"),
    seed: int = typer.Option(0, "--seed", help="seed of the initialization, batches and sampled data"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object on stdout"),
) -> None:
    """Train a speculative-decoding drafter (MTP or DFlash) for MODEL; ends with its greedy acceptance."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from engine.speculative.drafter_data import DrafterData, self_distillation_data, text_file_data
    from engine.speculative.drafter_train import (DATA_FILE, TrainConfig, drafter_acceptance, new_module,
                                                  train_drafter as run_training)

    cfg = TrainConfig(kind=kind, steps=steps, block_size=block_size, lr=lr, batch=batch, seq_len=seq_len, loss=loss,
                      train_vocab=train_vocab, num_layers=layers, intermediate_size=intermediate_size,
                      checkpoint_every=checkpoint_every, seed=seed)
    if weight_dtype == "auto" and device == "cpu":
        weight_dtype = "float32"
    loaded = load_cli_model(run_config(model, {"--device": device, "--weight-dtype": weight_dtype}), quiet=json_out)
    target_layers = cfg.drafter_config(loaded.config).target_layers
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
    data_path = out / DATA_FILE
    with Progress(*columns, console=err_console, transient=True, disable=json_out) as bar:
        if resume and data_path.exists():
            train_data = DrafterData.load(data_path)
        else:
            task = bar.add_task("scoring data", total=None, info="")
            progress = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
            if data == "self":
                train_data = self_distillation_data(loaded, target_layers, samples or 64, seq_len, seed=seed,
                                                    on_progress=progress)
            else:
                train_data = text_file_data(loaded, Path(data), target_layers, seq_len, seed=seed,
                                            max_sequences=samples, on_progress=progress)
            bar.remove_task(task)
            train_data.save(data_path)
        task = bar.add_task("training", total=cfg.steps, info="")

        def on_step(step: int, total: int, loss_value: float, top1: float) -> None:
            bar.update(task, completed=step, info=f"loss {loss_value:.3f} · top-1 {100 * top1:.0f}%")
        module, result = run_training(loaded, train_data, cfg, out, resume=resume, on_step=on_step)
        task = bar.add_task("measuring acceptance", total=None, info="")
        stats = drafter_acceptance(loaded, module, train_data, eval_tokens)
        untrained = None
        if baseline:
            fresh = new_module(module.cfg, loaded.config.vocab_size, seed)
            untrained = drafter_acceptance(loaded, fresh, train_data, eval_tokens)
    summary = {"kind": kind, "out": str(out / "drafter.safetensors"), "steps": result.step,
               "train_seconds": result.seconds, "loss": result.loss, "block_size": module.cfg.block_size,
               "sequences": train_data.num_sequences, "acceptance": stats.as_dict(),
               "untrained_acceptance": untrained.as_dict() if untrained else None}
    if json_out:
        print_json(summary)
        return
    err_console.print(f"trained {kind} drafter: {result.step} steps in {result.seconds:.1f}s (this run), "
                      f"loss {result.loss:.3f} → {summary['out']}")
    for label, s in (("untrained", untrained), ("trained", stats)):
        if s is None:
            continue
        per_position = " ".join(f"{100 * a:.0f}%" for a in s.as_dict()["acceptance_per_position"])
        err_console.print(f"{label} greedy acceptance (k = {module.cfg.block_size}, {len(train_data.eval_prompts)} "
                          f"held-out prompts): {100 * s.acceptance_rate:.1f}% of drafts, mean accepted length "
                          f"{s.mean_accepted_length:.2f} tokens/step, per position {per_position}")
