"""The memory plan of a concrete run, and the `max_gpu_memory` budget checked against it.

`model_formats` reads a model's per-tensor formats from its metadata only (a bonsai checkpoint's
safetensors header, a GGUF's tensor table; an HF directory is all float), `plan_run` builds the plan
(engine.memory.plan) for the run's settings, and `check_budget` refuses a plan over the limit with
one line saying what would fit: a shorter context, a smaller KV type, fewer slots, a smaller
prefill chunk, the embedding table in host memory, or offloading the KV cache / weights.
engine.memory.limit enforces the limit on the device while running.

`fit_to_budget` makes the two choices that cost neither quality nor decode speed when the user left
them open and the plan needs them under the limit: the embedding table in host memory (the decode
step stays CUDA-graphed: one row per token crosses PCIe) and a smaller prefill chunk (slower
prefill, smaller activations). Each choice made is reported in one line (`FitChoice`).
Under any limit, prefill unpacks packed matrices in slices (`run_settings`' unpack_slice_bytes).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import BonsaiError
from engine.memory.plan import MemoryPlan, PlanLine, RunSettings, make_plan
from engine.memory.stream_fit import stream_plan, stream_to_fit
from engine.memory.streaming import layer_ranges
from engine.runtime.decode_step import MAX_STEP_ROWS
from engine.sources.model_config import ModelConfig
from engine.speculative.draft_layers import DrafterConfig
from engine.speculative.draft_model import resolve_draft_model
from engine.speculative.drafter_file import resolve_path
from engine.weights.formats import LinearFormat, WeightFormat, linear_formats, stored_formats
from engine.weights.loader import open_model_source
from engine.weights.packed_linear import FIT_UNPACK_SLICE_BYTES

SMALLER_KV = {"bf16": ("int8", "k8v4", "int4"), "int8": ("k8v4", "int4"), "k8v4": ("int4",), "int4": ()}


def format_bytes(n: float) -> str:
    """Decimal units, as users write limits ('6GB')."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class ModelWeights:
    """What the plan needs of a model besides its settings: architecture and run-time formats."""
    config: ModelConfig
    formats: dict[str, LinearFormat]
    rotation_block: int = 0
    name: str = ""


def model_formats(source, config: ModelConfig, fmt: WeightFormat = WeightFormat(),
                  keep_codes: bool = False) -> ModelWeights:
    """The run-time formats `engine.weights.loader.load_model` gives the source's layers."""
    formats = linear_formats(config, fmt, stored_formats(source) if keep_codes else None)
    rotation = getattr(source, "rotation", None) or {}
    return ModelWeights(config, formats, int(rotation.get("down_proj_hadamard", 0)), str(getattr(source, "path", "")))


def dummy_formats(config: ModelConfig, fmt: WeightFormat = WeightFormat(), name: str = "") -> ModelWeights:
    """The run-time formats of `engine.weights.loader.load_dummy` (every layer generated in its format)."""
    return ModelWeights(config, linear_formats(config, fmt), 0, name)


def decode_splits(config: ModelConfig, max_seq_len: int, cuda: bool) -> int:
    """The split count engine.runtime.runner gives the decode attention kernel."""
    if not cuda:
        return 1
    try:
        from engine.kernels.attention_decode import default_num_splits
    except ImportError:  # no triton: the runner falls back to the plain path
        return 1
    return default_num_splits(max_seq_len, config.num_kv_heads, head_dim=config.head_dim)


def run_settings(config: ModelConfig, device: str, max_seq_len: int, slots: int = 1, prefill_chunk_size: int = 512,
                 kv_type: str = "bf16", graph_rows: int | None = None, weight_dtype_bytes: int | None = None,
                 weight_offload: bool = False, kv_offload: bool = False, rotation_block: int = 0,
                 dummy: bool = False, embedding_on_host: bool = False, verify_positions: int = 0,
                 limited: bool = False) -> RunSettings:
    """Settings as engine.weights.loader / engine.runtime.runner choose them on `device`: bfloat16 on CUDA with the
    fused decode step graphed for 1..graph_rows rows (default: one per slot, up to 16); float32 on
    the CPU with float16 block matrices (float32 for dummy weights) and no fused step. limited (a max_gpu_memory
    is set): prefill unpacks packed matrices in FIT_UNPACK_SLICE_BYTES slices, else whole (faster, a transient
    the size of the largest matrix's float Wᵀ: engine.weights.packed_linear)."""
    cuda = str(device).startswith("cuda")
    dtype_bytes = 2 if cuda else 4
    if weight_dtype_bytes is None:
        weight_dtype_bytes = dtype_bytes if cuda or dummy else 2
    if graph_rows is None:
        graph_rows = min(slots, MAX_STEP_ROWS) if cuda else 0
    return RunSettings(max_seq_len=max_seq_len, slots=slots, prefill_chunk_size=prefill_chunk_size, kv_type=kv_type,
                       cuda=cuda, dtype_bytes=dtype_bytes, weight_dtype_bytes=weight_dtype_bytes,
                       graph_rows=graph_rows, num_splits=decode_splits(config, max_seq_len, cuda),
                       weight_offload=weight_offload, kv_offload=kv_offload, rotation_block=rotation_block,
                       embedding_on_host=embedding_on_host, dummy=dummy,
                       verify_positions=verify_positions if config.hybrid is not None else 0,
                       unpack_slice_bytes=FIT_UNPACK_SLICE_BYTES if limited else 0)


def plan_run(weights: ModelWeights, settings: RunSettings, drafter: MemoryPlan | None = None) -> MemoryPlan:
    return make_plan(weights.config, weights.formats, settings, drafter)


def _vary(weights: ModelWeights, s: RunSettings, **changes) -> RunSettings:
    if "slots" in changes and s.graph_rows == min(s.slots, MAX_STEP_ROWS) and s.cuda:
        changes["graph_rows"] = min(changes["slots"], MAX_STEP_ROWS)  # a graph per slot count
    new = dataclasses.replace(s, **changes)
    if "max_seq_len" in changes:
        new = dataclasses.replace(new, num_splits=decode_splits(weights.config, new.max_seq_len, new.cuda))
    return new


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest n in [low, high] with fits(n) (fits is monotone), or None."""
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


# what each knob is called where the user sets it; None: the command cannot change it
SERVE_KEYS = {"max_seq_len": "runtime.max_seq_len", "slots": "runtime.max_batch_size",
              "prefill_chunk_size": "runtime.prefill_chunk_size", "kv_type": "KV cache type",
              "kv_offload": "memory.kv_offload", "weight_offload": "memory.weight_offload",
              "embedding_on_host": "memory.embedding_on_host"}
CLI_KEYS = {"max_seq_len": "--max-seq-len", "slots": None, "prefill_chunk_size": None, "kv_type": "--kv-type",
            "kv_offload": "--kv-offload", "weight_offload": None, "embedding_on_host": "--embedding-on-host"}
FLAG_KEYS = ("kv_offload", "embedding_on_host")  # switches: 'KEY: true' in a config, a flag on the CLI
AUTO_CHUNKS = (256, 128, 64)  # prefill chunks fit_to_budget tries, largest first


def host_embedding_possible(weights: ModelWeights) -> bool:
    """The table may leave the device unless the output layer is tied to it in float."""
    return not weights.config.tie_word_embeddings or "lm_head" in weights.formats


def _flag(keys: dict[str, str | None], key: str) -> str:
    name = keys[key]
    return name if name.startswith("--") else f"{name}: {'auto' if key == 'weight_offload' else 'true'}"


@dataclass(frozen=True)
class FitChoice:
    """A setting `fit_to_budget` chose, and why (one line for the plan's output and the logs)."""
    key: str
    value: object
    line: str


def fit_to_budget(weights: ModelWeights, s: RunSettings, limit: int | None, embedding_auto: bool,
                  chunk_auto: bool, drafter: MemoryPlan | None = None, stream_auto: bool = False
                  ) -> tuple[RunSettings, list[FitChoice]]:
    """The settings to run with: `s`, or, when its plan is over `limit`, `s` with the embedding
    table in host memory (if embedding_auto and possible) and then the largest prefill chunk of
    AUTO_CHUNKS below s's that fits (if chunk_auto), and then (if stream_auto: memory.weight_offload
    auto) the fewest blocks streamed from host memory that fit (engine.memory.stream_fit). When nothing
    fits, `s` with the embedding choice only, or every block streamed with stream_auto (the refusal's
    advice then starts from there)."""
    def fits(x: RunSettings) -> bool:
        return plan_run(weights, x, drafter).total <= limit

    if limit is None or fits(s):
        return s, []
    choices = []
    if embedding_auto and not s.embedding_on_host and not s.weight_offload and host_embedding_possible(weights):
        s = dataclasses.replace(s, embedding_on_host=True)
        table = weights.config.vocab_size * weights.config.hidden_size * s.dtype_bytes
        choices.append(FitChoice("embedding_on_host", True, f"embedding table in host memory ({format_bytes(table)} "
                                 "off the GPU; each step copies its rows in, the decode step stays graphed)"))
        if fits(s):
            return s, choices
    if chunk_auto:
        for chunk in AUTO_CHUNKS:
            smaller = dataclasses.replace(s, prefill_chunk_size=chunk)
            if chunk < s.prefill_chunk_size and fits(smaller):
                line = (f"prefill chunk {chunk} tokens instead of {s.prefill_chunk_size} (smaller activations "
                        "under max_gpu_memory; prefill is slower)")
                return smaller, choices + [FitChoice("prefill_chunk_size", chunk, line)]
    if stream_auto:
        streamed = stream_to_fit(weights.config, weights.formats, s, limit, drafter, host_embedding_possible(weights))
        if streamed is None:  # refused: its plan is the smallest (every block streamed)
            return dataclasses.replace(s, weight_offload=True, resident_layers=(),
                                       embedding_on_host=s.embedding_on_host or host_embedding_possible(weights)), choices
        sp = stream_plan(weights.config, weights.formats, streamed)
        line = (f"{len(sp.streamed)} of {sp.num_layers} blocks streamed from host memory each pass (layers "
                f"{layer_ranges(sp.streamed)}; {format_bytes(sp.streamed_bytes)} over PCIe a pass: ~"
                f"{sp.tokens_per_second():.1f} tok/s predicted), the other {len(sp.resident)} resident")
        return streamed, choices + [FitChoice("weight_offload", sp.streamed, line)]
    return s, choices


def what_fits(weights: ModelWeights, s: RunSettings, limit: int, keys: dict[str, str | None],
              drafter: MemoryPlan | None = None) -> list[str]:
    """Single changes of the settings whose plan fits in `limit` bytes, as 'key value' phrases."""
    def fits(**changes) -> bool:
        return plan_run(weights, _vary(weights, s, **changes), drafter).total <= limit

    out = []
    if keys.get("max_seq_len"):
        n = _largest(lambda n: fits(max_seq_len=n), 2, s.max_seq_len - 1)
        if n is not None:
            out.append(f"{keys['max_seq_len']} <= {n - n % 256 if n >= 512 else n}")
    if keys.get("kv_type"):
        kv = next((k for k in SMALLER_KV[s.kv_type] if fits(kv_type=k)), None)
        if kv is not None:
            out.append(f"{keys['kv_type']} {kv}")
    if keys.get("slots") and s.slots > 1:
        n = _largest(lambda n: fits(slots=n), 1, s.slots - 1)
        if n is not None:
            out.append(f"{keys['slots']} <= {n}")
    if keys.get("prefill_chunk_size"):
        chunk = next((c for c in (256, 128, 64, 32) if c < s.prefill_chunk_size and fits(prefill_chunk_size=c)), None)
        if chunk is not None:
            out.append(f"{keys['prefill_chunk_size']} <= {chunk}")
    if keys.get("weight_offload") and not s.weight_offload:  # the blocks that do not fit, streamed
        streamed = stream_to_fit(weights.config, weights.formats, s, limit, drafter, host_embedding_possible(weights))
        if streamed is not None:
            sp = stream_plan(weights.config, weights.formats, streamed)
            out.append(f"{keys['weight_offload']}: auto (streams {len(sp.streamed)} of {sp.num_layers} blocks: "
                       f"~{sp.tokens_per_second():.1f} tok/s predicted)")
    for key in FLAG_KEYS:
        if key == "embedding_on_host" and (s.weight_offload or not host_embedding_possible(weights)):
            continue
        if keys.get(key) and not getattr(s, key) and fits(**{key: True}):
            out.append(_flag(keys, key))
    if not out:  # two changes together
        for a, b in (("embedding_on_host", "kv_offload"), ("kv_offload", "weight_offload")):
            if (keys.get(a) and keys.get(b) and not getattr(s, a) and not getattr(s, b)
                    and (a != "embedding_on_host" or host_embedding_possible(weights)) and fits(**{a: True, b: True})):
                out.append(f"{_flag(keys, a)} with {_flag(keys, b)}")
                break
    return out


def check_budget(plan: MemoryPlan, limit: int | None, weights: ModelWeights, s: RunSettings,
                 keys: dict[str, str | None], option: str = "config memory.max_gpu_memory",
                 drafter: MemoryPlan | None = None) -> None:
    """Refuse (BonsaiError, one line) a plan over `limit` bytes, saying what would fit."""
    if limit is None or plan.total <= limit:
        return
    cats = plan.categories()
    kv = cats.get("kv", 0)
    parts = f"weights {format_bytes(cats.get('weights', 0))}, KV {format_bytes(kv)}, " \
            f"buffers {format_bytes(plan.total - cats.get('weights', 0) - kv)}"
    fits = what_fits(weights, s, limit, keys, drafter)
    advice = ("would fit: " + ", or ".join(fits)) if fits else \
        "no single change of the context, KV type, slots or offload makes it fit: use a smaller model or weight type"
    if s.weight_offload and not s.resident_layers:
        advice = (f"even with every block streamed from host memory (the staging ring alone on the GPU), "
                  f"{format_bytes(plan.total)} is the smallest max_gpu_memory this run fits; " + advice)
    raise BonsaiError(f"{option} {format_bytes(limit)}: the memory plan needs {format_bytes(plan.total)} ({parts}); "
                      f"{advice} (see bonsai info MODEL --plan)")


def draft_model_plan(path: str | Path, target_settings: RunSettings, num_draft_tokens: int) -> MemoryPlan:
    """A draft model (--spec draft:PATH) loaded on the target's device: its own weights, a KV cache of
    the target's context + k + 1, its own one-row decode step (engine.speculative.config)."""
    source = open_model_source(resolve_draft_model(str(path)))
    config = source.model_config()
    weights = model_formats(source, config, keep_codes=target_settings.cuda)
    s = dataclasses.replace(target_settings, max_seq_len=target_settings.max_seq_len + num_draft_tokens + 1, slots=1,
                            graph_rows=1 if target_settings.cuda else 0, weight_offload=False, kv_offload=False,
                            weight_dtype_bytes=target_settings.dtype_bytes if target_settings.cuda else 2,
                            kv_type="bf16", rotation_block=weights.rotation_block,
                            num_splits=decode_splits(config, target_settings.max_seq_len + num_draft_tokens + 1,
                                                     target_settings.cuda))
    return plan_run(weights, s)


def hidden_drafter_plan(method: str, path: str, settings: RunSettings, num_draft_tokens: int) -> MemoryPlan:
    """An MTP / DFlash drafter file: its tensors moved to the target's device and dtype (loaded once),
    and per slot its own KV cache [L, 1, KV, S, D] of the target's context + k + 1
    (engine.speculative.hidden_drafter)."""
    import json

    from safetensors import safe_open

    resolved = resolve_path(path)
    with safe_open(str(resolved), framework="pt") as f:
        config = DrafterConfig.from_dict(json.loads((f.metadata() or {})["config"]))
        numel = 0
        for name in f.keys():
            n = 1
            for dim in f.get_slice(name).get_shape():
                n *= dim
            numel += n
    capacity = settings.max_seq_len + num_draft_tokens + 1
    kv = 2 * config.num_layers * config.num_kv_heads * capacity * config.head_dim * settings.dtype_bytes * settings.slots
    return MemoryPlan([PlanLine("weights", f"{method} drafter layers", numel * settings.dtype_bytes),
                       PlanLine("kv", f"{method} drafter KV cache ({settings.slots} x {capacity} positions)", kv)])


def native_mtp_plan(config: ModelConfig, settings: RunSettings, num_draft_tokens: int) -> MemoryPlan:
    """A checkpoint's own MTP head (--spec mtp): one decoder layer + fc in the run's dtype, shared by the
    slots, and per slot its KV cache of the target's context + k + 1 (engine.speculative.native_mtp)."""
    from engine.speculative.native_mtp import native_mtp_numel
    capacity = settings.max_seq_len + num_draft_tokens + 1
    kv = 2 * config.num_kv_heads * capacity * config.head_dim * settings.dtype_bytes * settings.slots
    return MemoryPlan([PlanLine("weights", "mtp head (the model's own)", native_mtp_numel(config) * settings.dtype_bytes),
                       PlanLine("kv", f"mtp head KV cache ({settings.slots} x {capacity} positions)", kv)])


def drafter_plan(spec_config, settings: RunSettings, config: ModelConfig | None = None) -> MemoryPlan | None:
    """What the drafters of a SpeculativeConfig add to the device (n-gram tables live on the host);
    config: the target's (a native MTP head is sized from it)."""
    plans = []
    for spec in spec_config.drafters:
        if spec.method == "draft":
            plans.append(draft_model_plan(spec.path, settings, spec_config.num_draft_tokens))
        elif spec.method in ("mtp", "dflash") and spec.path:
            plans.append(hidden_drafter_plan(spec.method, spec.path, settings, spec_config.num_draft_tokens))
        elif spec.method == "mtp" and config is not None and config.hybrid is not None:
            plans.append(native_mtp_plan(config, settings, spec_config.num_draft_tokens))
    if not plans:
        return None
    return MemoryPlan([line for p in plans for line in p.lines], [line for p in plans for line in p.host_lines])
