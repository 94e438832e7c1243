"""Layer-by-layer quantization: every method of `bonsai quantize` with one decoder layer in memory.

The model is never loaded whole. For each decoder layer in order, its float tensors are read from
the source (engine.quantization.float_source: LoRA merged, rotation folded) into one Block on `device`; the
held-out evaluation windows run through it as the float reference (engine.quantization.quality scores them
later); its linears are quantized stage by stage (rtn: each alone; gptq / gsq: engine.quantization.calibration's
sequential stages on the calibration activations, which then go on through the quantized layer into
the next one, as sequential GPTQ does); its tensors are written; the Block is freed. The embedding
and the output layer are read and written in slices of rows; the output layer is quantized by GPTQ
slice by slice (rows are independent given the Hessian of the final-norm outputs). A tied embedding
is quantized last, as the output layer; an untied one first, by rtn, and the calibration sequences
are embedded with its quantized rows.

Peak memory (`predict_peak`): one layer in float32, the calibration activations, the largest Hessian
with GPTQ's factorization of it, one slice of the embedding, the assembled codes of the output layer
(int8, one byte a weight), and the evaluation windows' states.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.quantization.block_tuning import BlockTuningOptions, Quantized, tune_block
from engine.quantization.block_pass import float_stream
from engine.quantization.calibration import (CalibrationOptions, LayerInputs, Target, block_forward, block_targets, gsq_rows,
                                quantize_block, rotary_tables, weight_error)
from engine.sources.checkpoint_file import hf_name
from engine.runtime.model import Transformer, rotary_inverse_frequencies
from engine.sources.model_config import ModelConfig
from engine.quantization.float_source import EMBED, HEAD, FloatSource
from engine.quantization.report import GPTQ_SLICE_BYTES, SLICE_BYTES
from quant.checkpoint import CheckpointWriter
from quant.formats import QuantSpec, fp16_scales, quantize_rtn, relative_error, rounding_error
from quant.gptq import gptq_with_refits

EVAL_BATCH = 1  # evaluation windows per forward pass (a CPU's attention holds [B, heads, T, T] scores)
Record = Callable[..., None]  # (HF name, format label, bytes, (Σ err², Σ w²)) of each tensor written


@dataclass
class Batches:
    """Token sequences in batches of one length, and their hidden states as they go through the layers."""
    ids: list[torch.Tensor]  # [B, T] each
    hidden: list[torch.Tensor]  # [B, T, H] each


def batches_of(sequences: list[list[int]], batch: int) -> list[torch.Tensor]:
    """Consecutive sequences of one length, up to `batch` a batch: [B, T] each."""
    out: list[list[list[int]]] = []
    for s in sequences:
        if out and len(out[-1]) < batch and len(out[-1][0]) == len(s):
            out[-1].append(s)
        else:
            out.append([s])
    return [torch.tensor(b) for b in out]


def skeleton(config: ModelConfig, source: FloatSource, device: torch.device) -> Transformer:
    """The model on the meta device (nothing allocated) but its rotary frequencies and final norm."""
    with torch.device("meta"):
        model = Transformer(config)
    freq = source.read("rope_freqs") if "rope_freqs" in source.shapes else None
    model.inv_freq = rotary_inverse_frequencies(config, freq).to(device)
    model.norm.to_empty(device=device)
    model.norm.weight.data.copy_(source.read("norm.weight"))
    return model


def load_block(model: Transformer, layer: int, source: FloatSource, device: torch.device, down_block: int):
    block = model.layers[layer]
    block.to_empty(device=device)
    for name in source.layer_names(layer):
        model.load_tensor(name, source.read(name).to(device))
    if down_block:
        block.feed_forward.set_down_hadamard(down_block, device)
    return block


def free_block(model: Transformer, layer: int) -> None:
    model.layers[layer].to("meta")


def run_block(model: Transformer, block, batches: Batches) -> None:
    """The batches' hidden states through one block, in place of the old ones."""
    for i, x in enumerate(batches.hidden):
        batches.hidden[i] = block_forward(block, x, *rotary_tables(model, x.shape[1], x.device))


def gather_rows(source: FloatSource, name: str, ids: torch.Tensor, spec: QuantSpec | None = None
                ) -> torch.Tensor:
    """Rows `ids` [M] of the embedding / output layer, float32 [M, H] (rounded by rtn to `spec`)."""
    out = torch.empty(ids.numel(), source.shapes[name][1])
    rows = _slice_rows(source.shapes[name])
    for start in range(0, source.shapes[name][0], rows):
        inside = ((ids >= start) & (ids < start + rows)).nonzero()[:, 0]
        if inside.numel():
            w = source.read_rows(name, start, min(start + rows, source.shapes[name][0]))
            picked = w[ids[inside] - start]  # [m, H]
            if spec is not None and not spec.is_float:
                codes, scales = quantize_rtn(spec, picked)
                picked = (codes.float().reshape(picked.shape[0], -1, spec.group_size) * scales[..., None]
                          ).reshape(picked.shape)
            out[inside] = picked
    return out


def embed_batches(source: FloatSource, batches: list[torch.Tensor], spec: QuantSpec | None,
                  device: torch.device) -> list[torch.Tensor]:
    """The embedding rows of every batch [B, T] → [B, T, H] on `device` (the table read once)."""
    if not batches:
        return []
    rows = gather_rows(source, EMBED, torch.cat([b.reshape(-1) for b in batches]), spec)
    return [r.view(*b.shape, -1).to(device) for r, b in zip(rows.split([b.numel() for b in batches]), batches)]


def _slice_rows(shape: tuple[int, ...]) -> int:
    return max(1, SLICE_BYTES // (4 * shape[1]))


def write_rows_tensor(source: FloatSource, name: str, spec: QuantSpec | None, writer: CheckpointWriter,
                      record: Record, hessian: torch.Tensor | None, method: str, options: CalibrationOptions,
                      say: Callable[[str], None]) -> None:
    """Write the embedding or output layer read in slices of rows: float (bf16 / f32), rtn, or, given the
    Hessian of its inputs (an output layer and a calibration method), GPTQ slice by slice."""
    n, k = source.shapes[name]
    hf = "model.embed_tokens.weight" if name == EMBED else "lm_head.weight"
    rows = _slice_rows((n, k))
    if hessian is not None:
        rows = max(1, min(rows, GPTQ_SLICE_BYTES // (4 * k)))
    err = ref = 0.0
    floats = spec is None or spec.is_float
    if floats:  # filled slice by slice: never a float32 copy of the whole table
        out = torch.empty(n, k, dtype=torch.float32 if spec is None else torch.bfloat16)
    else:
        out = torch.empty(n, k, dtype=torch.int8)  # the codes
        out_scales = torch.empty(n, k // spec.group_size)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        w = source.read_rows(name, start, stop)  # [r, K]
        if floats:
            out[start:stop] = w
            if spec is not None:
                e, r = rounding_error(w, torch.bfloat16)
                err, ref = err + e, ref + r
            continue
        if hessian is None:
            codes, scales = quantize_rtn(spec, w)
        else:
            say(f"{hf}: gptq rows {start}-{stop} of {n}")
            codes, scales = gptq_with_refits(w.to(hessian.device), hessian, spec.quant_type, spec.group_size,
                                             options.damp, options.block_size, options.act_order, options.scale_refits)
            codes, scales = codes.cpu(), fp16_scales(scales.cpu())
        e, r = relative_error(w, codes, scales, spec.group_size)
        err, ref = err + e, ref + r
        out[start:stop], out_scales[start:stop] = codes, scales
    if floats:
        kind = "f32" if spec is None else "bf16"
        record(hf, kind, writer.write_float(hf, out, kind), (err, ref))
    else:
        record(hf, f"{spec.quant_type} g{spec.group_size}", writer.write_quantized(hf, spec, out, out_scales),
               (err, ref))


@dataclass
class LayerwiseInputs:
    """What the layer loop works on: the source, the per-tensor specs (HF names), the method, and the
    token sequences (calibration: gptq / gsq only; evaluation windows: the quality report, may be empty)."""
    source: FloatSource
    config: ModelConfig  # of the model written
    specs: dict[str, QuantSpec]
    method: str  # rtn | gptq | gsq
    options: CalibrationOptions
    calibration: list[list[int]]
    evaluation: list[list[int]]
    kept: frozenset[str] = frozenset()  # HF names already written from the source's own codes
    down_block: int = 0  # online Hadamard block of a rotated model's down_proj
    tuning: BlockTuningOptions = BlockTuningOptions()  # block-wise scale tuning (gptq / gsq; steps 0: off)
    tuning_reports: list[dict] = field(default_factory=list)  # filled: block tuning's report of each layer


def quantize_layers(job: LayerwiseInputs, writer: CheckpointWriter, record: Record,
                    progress: Callable[[str, int, int], None]) -> torch.Tensor | None:
    """Quantize and write every tensor, layer by layer. Returns the evaluation windows' final-norm
    states of the float model [positions, H] (None without evaluation windows)."""
    src, cfg, specs, opts = job.source, job.config, job.specs, job.options
    dev = torch.device(opts.device)
    calibrated = job.method in ("gptq", "gsq")
    steps = cfg.num_layers + 2
    say = lambda message: progress(message, done[0], steps)  # noqa: E731
    done = [0]
    model = skeleton(cfg, src, dev)
    for name in ("norm.weight", "rope_freqs"):
        if name in src.shapes:
            hf = "model.norm.weight" if name == "norm.weight" else name
            record(hf, "f32", writer.write_float(hf, src.read(name), "f32"))
    # the embedding: the calibration / evaluation inputs, then (untied) quantized and written
    embed_spec = specs.get("model.embed_tokens.weight")
    calib = batches_of(job.calibration, opts.batch_sequences) if calibrated else []
    evals = batches_of(job.evaluation, EVAL_BATCH)
    quantized_inputs = None if src.tied else embed_spec
    calib_batches = Batches(calib, embed_batches(src, calib, quantized_inputs, dev))
    tune = calibrated and job.tuning.steps > 0
    asymmetric = calibrated and opts.asymmetric > 0
    # block tuning, asymmetric calibration: the float model's states of the calibration, [B, T, H] each
    float_states: list[torch.Tensor] = []
    if tune or asymmetric:
        rounded = quantized_inputs is not None and not quantized_inputs.is_float
        float_states = embed_batches(src, calib, None, dev) if rounded else [x.clone() for x in calib_batches.hidden]
    ref_batches = Batches(evals, embed_batches(src, evals, None, dev))
    if not src.tied:
        say("model.embed_tokens.weight")
        write_rows_tensor(src, EMBED, embed_spec, writer, record, None, "rtn", opts, say)
    done[0] += 1
    keep = gsq_rows(calib_batches.hidden, opts) if job.method == "gsq" and calib else None
    plan = lambda name: (s if (s := specs.get(name)) is not None and not s.is_float and name not in job.kept  # noqa: E731
                         else None)
    with torch.no_grad():
        for i in range(cfg.num_layers):
            say(f"layer {i + 1}/{cfg.num_layers}")
            block = load_block(model, i, src, dev, job.down_block)
            run_block(model, block, ref_batches)
            targets = block_targets(block, i, cfg, plan)
            by_name = {t.name: t for group in targets.values() for t in group}
            if calibrated:
                floats = float_stream(block, float_states, model) if asymmetric and by_name else None
                if tune or asymmetric:  # the float model's outputs of this block: the tuning's targets, the next float states
                    float_states = floats.outputs if floats else [block_forward(block, x, *rotary_tables(model, x.shape[1], dev))
                                                                   for x in float_states]
                tuned = tune and bool(by_name)
                inputs = calib_batches.hidden if tuned else None
                stages = quantize_block(block, calib_batches.hidden, targets, keep, job.method, opts, model, say, floats)
                del floats
                done_tensors = []
                while True:
                    try:
                        name, codes, scales, spec = next(stages)
                    except StopIteration as end:
                        calib_batches.hidden = end.value
                        break
                    if tuned:
                        done_tensors.append(Quantized(by_name[name], codes, scales))
                    else:
                        _write_target(writer, record, by_name[name], codes, scales)
                if tuned:
                    say(f"layer {i + 1}/{cfg.num_layers}: block tuning")
                    calib_batches.hidden, tuning = tune_block(block, model, inputs, float_states, calib_batches.hidden,
                                                              done_tensors, job.tuning, say)
                    job.tuning_reports.append({"layer": i, **tuning})
                    del inputs
                    for q in done_tensors:
                        q.target.error = weight_error(q.target.sums, q.scales)
                        _write_target(writer, record, q.target, q.codes, q.scales)
            else:
                for target in by_name.values():
                    w = target.param[target.start:target.start + target.rows].float()
                    codes, scales = quantize_rtn(target.spec, w)
                    target.error = relative_error(w, codes, scales, target.spec.group_size)
                    _write_target(writer, record, target, codes.cpu(), scales.cpu())
            _write_others(src, i, set(by_name) | job.kept, specs, writer, record)
            free_block(model, i)
            done[0] += 1
        # the output layer (a tied embedding: the embedding too), on the final-norm outputs
        head = EMBED if src.tied else HEAD
        hessian = None
        if calibrated and plan("model.embed_tokens.weight" if src.tied else "lm_head.weight") is not None:
            inputs = LayerInputs(cfg.hidden_size, dev, None)
            for x in calib_batches.hidden:
                inputs.add(model.norm(x))
            hessian = inputs.hessian
        del calib_batches, float_states
        say("output layer")
        head_hf = "model.embed_tokens.weight" if head == EMBED else "lm_head.weight"
        if head_hf not in job.kept:
            write_rows_tensor(src, head, specs.get(head_hf), writer, record, hessian, job.method, opts, say)
        done[0] += 1
        progress("written", steps, steps)
        if not evals:
            return None
        return torch.cat([model.norm(x)[:, :-1].reshape(-1, cfg.hidden_size) for x in ref_batches.hidden])


def _write_target(writer: CheckpointWriter, record: Record, target: Target, codes: torch.Tensor,
                  scales: torch.Tensor) -> None:
    spec = target.spec
    record(target.name, f"{spec.quant_type} g{spec.group_size}", writer.write_quantized(target.name, spec, codes, scales),
           target.error or (0.0, 0.0))


def _write_others(src: FloatSource, layer: int, done: set[str], specs: dict[str, QuantSpec],
                  writer: CheckpointWriter, record: Record) -> None:
    """The layer's tensors not quantized: norms, biases (f32) and matrices a recipe keeps in bf16."""
    for name in src.layer_names(layer):
        hf = hf_name(name)
        if hf in done:
            continue
        w = src.read(name)
        spec = specs.get(hf)
        if spec is None:
            record(hf, "f32", writer.write_float(hf, w, "f32"))
        else:
            record(hf, "bf16", writer.write_float(hf, w, "bf16"), rounding_error(w, torch.bfloat16))
