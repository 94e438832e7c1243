"""What to run, from the command line: MODEL and the flags (or a serve.yaml with --config) as the
run config engine.run.config describes, and open_run with a spinner.

Each flag sets one key of the config (`--kv-type int8` is `model.kv_type: int8`); with --config FILE
the file's keys come first and the flags given override them. A refusal of the config names the
flag when a flag set the key. The serve file's `server:` section is read by `bonsai serve` alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from bonsai_cli.common import err_console

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"
FLAG_KEYS = {  # flag → the config key it sets
    "--device": "runtime.device", "--slots": "runtime.max_batch_size", "--weight-dtype": "runtime.weight_dtype",
    "--cpu-int4": "runtime.cpu_int4", "--cpu-kernels": "runtime.cpu_kernels", "--output-dtype": "runtime.output_dtype",
    "--max-seq-len": "runtime.max_seq_len", "--kv-type": "model.kv_type", "--weights": "model.quant_type",
    "--group-size": "model.group_size", "--head-weights": "model.head_type", "--load-format": "model.load_format",
    "--ternary-layout": "model.ternary_layout",
    "--pipeline-parallel": "memory.pipeline_parallel", "--kv-offload": "memory.kv_offload",
    "--host-kv-mib": "memory.host_kv_mib", "--max-gpu-memory": "memory.max_gpu_memory",
    "--embedding-on-host": "memory.embedding_on_host", "--spec": "speculative.method",
    "--draft-tokens": "speculative.num_draft_tokens",
}
SPEC_OFF = ("", "none", "off")
SWITCHES = ("--pipeline-parallel", "--kv-offload")  # on/off flags: off means not given

DEVICE_HELP = "cpu or cuda[:N] (default cpu); with --pipeline-parallel a list such as cuda:0,cuda:1 (or cpu,cpu)"
PIPELINE_HELP = ("split the model's layers across the devices listed in --device (e.g. cuda:0,cuda:1; cpu,cpu "
                 "runs two CPU processes), one process per device, balanced by bytes (bonsai info --plan shows "
                 "the split)")
CONFIG_HELP = "serve.yaml: run what it describes (model, runtime, memory, speculative, ...); flags given override it"
MAX_GPU_MEMORY_HELP = ("hard GPU memory limit, e.g. 6GB or 5.5GiB: the memory plan is checked before loading "
                       "(refused with what would fit; the embedding table goes to host memory and the prefill chunk "
                       "shrinks when that makes it fit) and the CUDA allocator is capped at it (no cap on the CPU)")
EMBEDDING_ON_HOST_HELP = ("keep the embedding table in host memory (each step copies its tokens' rows to the GPU; the "
                          "decode step stays CUDA-graphed). Default: only when --max-gpu-memory needs it")
WEIGHT_DTYPE_HELP = ("matrix storage: auto (on CPU float16 matrices: half float32's bytes, mean KL 2e-6 vs "
                     "float32, greedy output may differ at exact near-ties; bfloat16 beside --cpu-int4's 4-bit "
                     "matrices on CPUs with bf16 GEMM; on GPU the compute dtype), "
                     "float32 (exact), float16, bfloat16 (on a CPU with AVX512-BF16: one bf16 GEMM at every row "
                     "count, so a speculative verify pass costs about one decode step and prompts run 2-7x "
                     "faster; plain decode 0.8-1.15x float16's, docs/perf.md)")
CPU_INT4_HELP = ("on the CPU, run a GGUF's block matrices as stored (by --cpu-kernels: native reads every K-quant "
                 "and legacy type at its size; torch reads Q4_0/Q4_1/Q4_K, Q5_0/Q5_1/Q8_0 as two 4-bit halves and "
                 "keeps Q6_K as bfloat16; quality in docs/quality.md). Default: on when --weight-dtype is auto and "
                 "the weights are as loaded")
CPU_KERNELS_HELP = ("which kernels run the block matrices on the CPU: native (bonsai's own, compiled on first use "
                    "with the machine's C compiler: Q4_K/Q6_K/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 at their stored size, "
                    "activations in two int8 passes: the float32 model's outputs), torch (torch's int4 kernel, bfloat16 activations, Q6_K as floats) "
                    "or auto (native where the CPU has AVX512-VNNI or AVX2 and a compiler works, else torch)")
OUTPUT_DTYPE_HELP = ("the CPU output layer: float32 (exact), float16 (one float16 GEMM, the logits near each row's "
                     "largest recomputed in float32: the same greedy choice, 2x fewer bytes a token), int8 (one "
                     "int8-weight GEMM, the same recomputation, 4x fewer bytes; the other logits within ~0.02: "
                     "docs/quality.md; float16 on CPUs without AVX512) or auto (int8 when --weight-dtype is auto)")
WEIGHTS_HELP = ("run-time weight format of the block matrices: bf16 (as loaded) or tri | bin | int4 | int8 "
                "(rounded to nearest at load, or generated with --load-format dummy), run by the packed kernels")
KV_TYPE_HELP = ("KV-cache element type: bf16 (the model's dtype), int8 (per-row scale), int4 (groups of 32, "
                "scale + min) or k8v4 (int8 keys, int4 values); quality vs bf16 in docs/quality.md")
SPEC_HELP = ("speculative decoding: ngram | draft:PATH|NAME (e.g. draft:qwen2.5-coder-0.5b) | mtp[:PATH] | "
             "dflash[:PATH] | mix:ngram,draft:PATH,... (same output at temperature 0, same distribution above)")
DRAFT_TOKENS_HELP = "most tokens drafted per step (k); with one drafter or a mix the length adapts up to it"
KV_OFFLOAD_HELP = ("keep the KV cache in (pinned) host memory and stream each layer's rows to the GPU ahead of use "
                   "(long contexts on small GPUs; decoding then runs at PCIe speed, without CUDA graphs)")
HOST_KV_MIB_HELP = "with --kv-offload: host memory granted to the KV cache in MiB (default: what it needs)"
LOAD_FORMAT_HELP = ("auto (read the model's weights) or dummy: MODEL is an architecture YAML (configs/models/NAME.yaml "
                    "or a path) built at full size with random weights, for speed measurements")


def read_config_file(path: Path, overrides: dict[str, Any] | None = None) -> Any:
    """A serve.yaml as a mapping of sections, with `section.key` overrides (None: not given)."""
    import yaml

    from engine.errors import BonsaiError
    if not path.is_file():
        raise BonsaiError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise BonsaiError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if isinstance(data, dict):
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
        for dotted, value in (overrides or {}).items():
            if value is not None:
                section, key = dotted.split(".")
                if data.get(section) is None:
                    data[section] = {}
                if isinstance(data[section], dict):
                    data[section][key] = value
    return data


def dummy_architecture(model: str | None):
    """(ModelConfig, path) of a dummy model's architecture YAML: a path, or a name under configs/models."""
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


def architecture_of(config):
    """With model.load_format dummy: the ModelConfig of model.path (an architecture YAML), else None."""
    return dummy_architecture(config.model.path)[0] if config.model.load_format == "dummy" else None


def run_config(model: Optional[str], flags: dict[str, Any], config_file: Optional[Path] = None,
               config_class: Any = None):
    """The run config of MODEL and the flags (flag → value; None or False: not given), on top of
    `config_file`'s keys when given. config_class: RunConfig (default) or the server's ServeConfig."""
    from engine.errors import BonsaiError
    from engine.run.config import RunConfig
    from engine.sources import store
    cls = config_class or RunConfig
    if config_file is not None:
        data = read_config_file(config_file)
        if not isinstance(data, dict):
            return cls.from_dict(data)  # its one-line error
    else:
        data = {}
    given = {flag: value for flag, value in flags.items()
             if value is not None and not (flag in SWITCHES and value is False)}
    if model is not None or config_file is None:
        given["model.path"] = model or store.DEFAULT_MODEL
    spec = given.pop("--spec", None)
    draft_tokens = given.pop("--draft-tokens", None)
    for flag, value in given.items():
        section, key = FLAG_KEYS.get(flag, flag).split(".")
        data[section] = {**(data.get(section) or {}), key: value}
    if spec is not None:
        runtime = data.setdefault("runtime", {})
        if spec.strip().lower() in SPEC_OFF:
            runtime["decode_algorithm"] = "standard"
            runtime.pop("draft_model", None)
            data.pop("speculative", None)
        else:
            runtime["decode_algorithm"] = "speculative"
            runtime.pop("draft_model", None)
            data["speculative"] = {**(data.get("speculative") or {}), "method": spec}
            if draft_tokens is not None:
                data["speculative"]["num_draft_tokens"] = draft_tokens
            given["--spec"] = spec
    names = {FLAG_KEYS[f]: f for f in (FLAG_KEYS if config_file is None else given) if f in FLAG_KEYS}
    try:
        return cls.from_dict(data, ignore=() if config_class else ("server",))
    except BonsaiError as e:
        raise BonsaiError(as_flags(str(e), names)) from None


def as_flags(message: str, names: dict[str, str]) -> str:
    """A config refusal in the words of the command line: each key a flag set is named as that flag."""
    if "--spec" in names.values() and message.startswith("config speculative: "):
        message = "--spec: " + message[len("config speculative: "):]
    for key in sorted(names, key=len, reverse=True):
        message = message.replace(f"{key}: true", names[key]).replace(key, names[key])
    return message[len("config "):] if message.startswith("config --") else message


def open_cli_run(config, quiet: bool = False, auto_pull: bool = False, from_flags: bool = True):
    """open_run with a spinner and one line about what loaded. from_flags: the refusal of a plan over
    the limit names the flags (else the config's keys)."""
    from engine.memory.budget import CLI_KEYS, SERVE_KEYS
    from engine.run.builder import open_run
    architecture = architecture_of(config)
    keys, option = (CLI_KEYS, "--max-gpu-memory") if from_flags else (SERVE_KEYS, "config memory.max_gpu_memory")
    if quiet:
        return open_run(config, architecture, auto_pull=auto_pull, keys=keys, option=option)
    with err_console.status(f"loading {config.model.path} on {config.runtime.device}") as status:
        run = open_run(config, architecture, auto_pull=auto_pull, keys=keys, option=option,
                       progress=lambda stage, fraction: status.update(stage))
    for choice in run.plan.choices:
        err_console.print(f"[dim]to fit --max-gpu-memory: {choice.line}[/dim]")
    if run.pipeline is not None:
        split = ", ".join(f"{s.device}: {s.label}" for s in run.pipeline.stages)
        err_console.print(f"[dim]pipeline over {len(run.pipeline.stages)} devices ({run.pipeline.backend}): "
                          f"{split}[/dim]")
    else:
        _say_loaded(run.loaded)
    return run


def load_cli_model(config, quiet: bool = False):
    """The config's model alone (no runner: `bonsai train-drafter` trains on it), with a spinner."""
    from engine.run.builder import load_run_model
    if quiet:
        return load_run_model(config, architecture_of(config))[0]
    with err_console.status(f"loading {config.model.path} on {config.runtime.device}") as status:
        loaded, _ = load_run_model(config, architecture_of(config), progress=lambda stage, f: status.update(stage))
    _say_loaded(loaded)
    return loaded


def _say_loaded(loaded) -> None:
    if loaded.summary.format == "dummy":
        err_console.print(f"[dim]generated {loaded.path.name}: {loaded.config.num_parameters() / 1e9:.2f}B "
                          f"parameters, {loaded.summary.file_bytes / 1e9:.2f} GB in {loaded.load_seconds:.1f}s[/dim]")
    else:
        err_console.print(f"[dim]loaded {loaded.config.architecture} model {loaded.path.name} "
                          f"({loaded.summary.num_parameters / 1e6:.0f}M parameters) in {loaded.load_seconds:.1f}s[/dim]")
