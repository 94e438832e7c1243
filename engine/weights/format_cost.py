"""Whether serving a model rounds its stored weights to another format at load, and what that costs.

`model.quant_type` other than bf16 packs the block matrices for the packed kernels. A matrix the
file already stores in that format (a checkpoint `bonsai quantize` made, a TQ1_0 GGUF), or keeps
packed as stored, loses nothing; any other is rounded to nearest at load, which can destroy a
model (SmolLM2 rounded to ternary answers garbage). That is never silent: the cost is measured on
a few hundred tokens of text, KL divergence and same top token of the rounded weights against the
stored ones (both on the CPU, the rounded matrices dequantized: the values the packed kernels
multiply by), and said in one line with the command that quantizes properly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.sources.checkpoint_file import BonsaiCheckpoint
from engine.sources.checkpoint_file import canonical_name as checkpoint_canonical
from engine.sources.gguf_file import GGUFFile
from engine.sources.gguf_file import canonical_name as gguf_canonical
from engine.sources.hf_files import canonical_name as hf_canonical
from engine.memory.budget import stored_formats
from engine.memory.plan import linear_modules
from engine.sources.model_config import ModelConfig

log = logging.getLogger(__name__)
MEASURE_TOKENS = 256
MEASURE_MAX_PARAMETERS = 1_000_000_000  # a float32 copy on the CPU: 4 GB
_KIND_NAMES = {"tri": "ternary", "bin": "1-bit", "int4": "int4", "int8": "int8"}


@dataclass(frozen=True)
class Rounding:
    path: Path
    quant_type: str
    group_size: int
    stored: str  # how the file stores the rounded matrices, e.g. "Q4_1", "BF16", "int4 g128"
    modules: tuple[str, ...]  # the Linear modules rounded at load
    kl_mean: float | None = None
    same_top: float | None = None
    tokens: int = 0
    unmeasured: str | None = None  # why the cost was not measured

    def message(self) -> str:
        kind = _KIND_NAMES.get(self.quant_type, self.quant_type)
        cost = (f"measured on {self.tokens} tokens against the stored weights: mean KL {self.kl_mean:.3f}, same "
                f"top token {100 * self.same_top:.0f}%" if self.kl_mean is not None else
                f"its cost was not measured ({self.unmeasured})")
        return (f"model.quant_type {self.quant_type}: {self.path} stores its block matrices as {self.stored}, so "
                f"{len(self.modules)} of them are rounded to nearest {kind} (groups of {self.group_size}) at load; "
                f"{cost}. For a usable {kind} model quantize it with `bonsai quantize {self.path} OUT --quant-type "
                f"{self.quant_type} --method gptq` (or --method gsq) and serve OUT, or set model.quant_type: bf16 "
                "to serve the stored weights")


def rounding_at_load(source, config: ModelConfig, quant_type: str, group_size: int,
                     keep_codes: bool) -> Rounding | None:
    """The block matrices loading with this quant_type rounds from another stored format (the
    loader's rules: engine.memory.plan.linear_formats), from metadata only; None when none is."""
    if quant_type == "bf16":
        return None
    stored = stored_formats(source)
    rounded = []
    for module, _, _, parts in linear_modules(config):
        if module == "lm_head":
            continue
        found = {stored.get(p) for p in parts}
        kept = keep_codes and len(found) == 1 and None not in found
        if not kept and found != {(quant_type, group_size)}:
            rounded.append(module)
    if not rounded:
        return None
    labels = _stored_labels(source)
    part = next(parts for module, _, _, parts in linear_modules(config) if module == rounded[0])[0]
    return Rounding(Path(source.path), quant_type, group_size, labels.get(part, "float"), tuple(rounded))


def _stored_labels(source) -> dict[str, str]:
    """canonical tensor name → its stored type as `bonsai info` shows it."""
    canonical = (gguf_canonical if isinstance(source, GGUFFile) else
                 checkpoint_canonical if isinstance(source, BonsaiCheckpoint) else hf_canonical)
    return {canon: label for name, label, _, _ in source.tensor_info() if (canon := canonical(name))}


@torch.inference_mode()
def measure(rounding: Rounding, tokens: int = MEASURE_TOKENS) -> Rounding:
    """The rounding's cost: the stored weights on the CPU as floats, teacher-forced on the first
    `tokens` tokens of engine.quantization.evaluate's default text; then its modules rounded (the load's RTN,
    dequantized) and the same again; KL(stored ‖ rounded) and same top token."""
    from engine.quantization.evaluate import Tally, default_eval_text, window_logprobs
    from engine.weights.loader import load_model, open_model_source
    from engine.weights.packed_linear import quantize_weight
    from engine.runtime.runner import ModelRunner
    from quant.packed_layout import dequantize
    params = open_model_source(rounding.path).model_config().num_parameters()
    if params > MEASURE_MAX_PARAMETERS:
        return replace(rounding, unmeasured=f"{params / 1e9:.1f}B parameters: too many to measure on the CPU at "
                                            "load; `bonsai eval` the quantized model against this one")
    loaded = load_model(rounding.path, "cpu", weight_dtype=torch.float32)
    ids = loaded.require_tokenizer().encode(default_eval_text())[:tokens]
    runner = ModelRunner(loaded, max_seq_len=len(ids), num_slots=1, prefill_chunk_size=len(ids))
    stored = window_logprobs(runner, ids)  # [L-1, V]
    for name in rounding.modules:
        weight = loaded.model.get_submodule(name).weight
        weight.copy_(dequantize(quantize_weight(weight.float(), rounding.quant_type, rounding.group_size)))
    tally = Tally()
    tally.add(window_logprobs(runner, ids), stored, torch.tensor(ids[1:]))
    result = tally.result()
    return replace(rounding, kl_mean=result.kl_mean, same_top=result.same_top, tokens=result.tokens)


def warn_if_rounded(path: Path, quant_type: str, group_size: int, keep_codes: bool) -> Rounding | None:
    """At load: log (warning) what rounding the stored matrices to quant_type costs; None if nothing is rounded."""
    from engine.weights.loader import open_model_source
    source = open_model_source(path)
    rounding = rounding_at_load(source, source.model_config(), quant_type, group_size, keep_codes)
    if rounding is not None:
        rounding = measure(rounding)
        log.warning("%s", rounding.message())
    return rounding
