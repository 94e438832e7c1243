"""Helpers shared by the commands: stderr console, model resolution and loading with a spinner."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

err_console = Console(stderr=True)


def print_choices(budget) -> None:
    """One dim line per setting the memory plan chose to fit --max-gpu-memory."""
    for choice in budget.choices:
        err_console.print(f"[dim]to fit --max-gpu-memory: {choice.line}[/dim]")


def print_json(obj: Any) -> None:
    """The one JSON object a --json command prints on stdout."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


WEIGHT_DTYPE_HELP = ("matrix storage: auto (on CPU float16 matrices: ~1.75x faster decode, mean KL 2e-6 vs "
                     "float32, greedy output may differ at exact near-ties; on GPU the compute dtype), "
                     "float32 (exact), float16, bfloat16")


def parse_weight_dtype(name: str):
    import torch

    from engine.errors import BonsaiError
    choices = {"auto": None, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in choices:
        raise BonsaiError(f"unknown --weight-dtype '{name}': use one of {', '.join(choices)}")
    return choices[name]


WEIGHTS_HELP = ("run-time weight format of the block matrices: bf16 (as loaded) or tri | bin | int4 | int8 "
                "(rounded to nearest at load, or generated with --load-format dummy), run by the packed kernels")
KV_TYPE_HELP = ("KV-cache element type: bf16 (the model's dtype), int8 (per-row scale), int4 (groups of 32, "
                "scale + min) or k8v4 (int8 keys, int4 values); quality vs bf16 in docs/quality.md")
SPEC_HELP = ("speculative decoding: ngram | draft:PATH | mtp[:PATH] | dflash[:PATH] | mix:ngram,draft:PATH,... "
             "(same output at temperature 0, same distribution above)")
DRAFT_TOKENS_HELP = "most tokens drafted per step (k); with one drafter or a mix the length adapts up to it"


def speculative_config(spec: str | None, draft_tokens: int):
    """--spec / --draft-tokens as a validated config (None: plain decoding); checked before loading."""
    from engine.speculative.config import spec_config_from_options
    return spec_config_from_options(spec, draft_tokens)


def spec_summary(spec) -> str:
    """One line of draft statistics for the terminal."""
    per = ", ".join(f"{name} {c.accepted}/{c.drafted}" for name, c in spec.by_drafter.items())
    return (f"speculative {spec.method}: {spec.accepted}/{spec.drafted} drafted tokens accepted "
            f"({100 * spec.acceptance:.0f}%), {spec.mean_accepted_length:.2f} tokens per target pass"
            + (f" [{per}]" if len(spec.by_drafter) > 1 else ""))


KV_OFFLOAD_HELP = ("keep the KV cache in (pinned) host memory and stream each layer's rows to the GPU ahead of use "
                   "(long contexts on small GPUs; decoding then runs at PCIe speed, without CUDA graphs)")
HOST_KV_MIB_HELP = "with --kv-offload: host memory granted to the KV cache in MiB (default: what it needs)"


def kv_offload_options(kv_offload: bool, host_kv_mib: int | None) -> dict[str, Any]:
    """--kv-offload / --host-kv-mib as ModelRunner arguments; checked before loading."""
    from engine.errors import BonsaiError
    if host_kv_mib is not None and not kv_offload:
        raise BonsaiError("--host-kv-mib only applies with --kv-offload")
    if host_kv_mib is not None and host_kv_mib < 1:
        raise BonsaiError(f"--host-kv-mib must be >= 1, got {host_kv_mib}")
    return {"kv_offload": kv_offload, "host_kv_bytes": host_kv_mib * 2**20 if host_kv_mib else None}


LOAD_FORMAT_HELP = ("auto (read the model's weights) or dummy: MODEL is an architecture YAML (configs/models/NAME.yaml "
                    "or a path) built at full size with random weights, for speed measurements")
MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"


def weight_format_from_options(weights: str, group_size: int, head_weights: str):
    from engine.weights.formats import WeightFormat
    return WeightFormat(quant_type=weights, group_size=group_size, head_type=head_weights)


def _dummy_config(model: str | None):
    """The architecture YAML of a dummy model: a path, or a name under configs/models."""
    import yaml

    from engine.errors import BonsaiError
    from engine.sources.model_config import ModelConfig
    if not model:
        raise BonsaiError("--load-format dummy needs MODEL: an architecture YAML such as configs/models/qwen3-8b.yaml")
    path = Path(model)
    if not path.exists():
        path = MODEL_CONFIGS / f"{model}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in MODEL_CONFIGS.glob("*.yaml")))
        raise BonsaiError(f"no architecture file '{model}': give a YAML path or one of: {known}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise BonsaiError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise BonsaiError(f"{path} must be a mapping of config.json keys (hidden_size, num_hidden_layers, ...)")
    try:
        return ModelConfig.from_hf_config(data), path
    except KeyError as e:
        raise BonsaiError(f"{path} lacks the key {e.args[0]}") from None


def load_for_cli(model: str | None, device: str, quiet: bool = False, auto_pull: bool = False,
                 weight_dtype: str = "auto", weights: str = "bf16", group_size: int = 128,
                 head_weights: str = "bf16", load_format: str = "auto", embedding_on_host: bool = False):
    """Resolve MODEL (path or pulled name; the default model when None) and load it (the embedding
    table in host memory with embedding_on_host)."""
    from engine.sources import store
    from engine.errors import BonsaiError
    from engine.weights.loader import load_dummy, load_model

    wdtype = parse_weight_dtype(weight_dtype)
    fmt = weight_format_from_options(weights, group_size, head_weights)
    if load_format not in ("auto", "dummy"):
        raise BonsaiError(f"unknown --load-format '{load_format}': use auto or dummy")
    if load_format == "dummy":
        config, path = _dummy_config(model)
        with err_console.status(f"generating {path.stem} ({weights}) on {device}"):
            loaded = load_dummy(config, path.stem, device=device, weight_format=fmt,
                                embedding_on_host=embedding_on_host)
        if not quiet:
            err_console.print(f"[dim]generated {path.stem}: {config.num_parameters() / 1e9:.2f}B parameters, "
                              f"{loaded.summary.file_bytes / 1e9:.2f} GB in {loaded.load_seconds:.1f}s[/dim]")
        return loaded

    spec = model or store.DEFAULT_MODEL
    log = (lambda s: None) if quiet else (lambda s: err_console.print(f"[dim]{s}[/dim]"))
    path = store.resolve_model(spec, auto_pull=auto_pull or model is None, log=log)
    if quiet:
        return load_model(path, device=device, weight_dtype=wdtype, weight_format=fmt,
                          embedding_on_host=embedding_on_host)
    with err_console.status(f"loading {path.name} on {device}"):
        loaded = load_model(path, device=device, weight_dtype=wdtype, weight_format=fmt,
                            embedding_on_host=embedding_on_host)
    err_console.print(f"[dim]loaded {loaded.config.architecture} model {path.name} "
                      f"({loaded.summary.num_parameters / 1e6:.0f}M parameters) in {loaded.load_seconds:.1f}s[/dim]")
    return loaded
