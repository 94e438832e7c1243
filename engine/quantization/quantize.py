"""`bonsai quantize`: a source model (HF dir, GGUF, bonsai checkpoint) → a bonsai checkpoint, layer by layer.

Every method runs through engine.quantization.layerwise: one decoder layer of the source is read at a time
(memory-mapped GGUF or plain safetensors reads, LoRA merged, rotation folded), quantized (rtn, gptq
with scale refits, gsq), written and freed, so memory is set by the largest layer, not by the depth
(engine.quantization.report.predict_peak says how much, before starting). Tensors that a GGUF or
checkpoint already holds as codes on a grid the plan allows are kept, not requantized (rtn).
`tune_steps` then trains every group scale end to end (engine.quantization.scale_tuning: the whole model twice in
memory, for GPUs and small models) and rewrites the checkpoint. Last, unless `evaluate` is off, the
written checkpoint is scored against the source on held-out text (engine.quantization.quality), the scores
go into the report and into `quality.json` in the checkpoint. Everything is written to a temporary
directory renamed at the end.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from engine.sources.checkpoint_file import hf_config, hf_name
from engine.errors import BonsaiError
from engine.quantization.evaluate import default_calibration_text, read_eval_text, windows_of
from engine.quantization.gguf_export import export_gguf
from engine.sources.gguf_file import GGUFFile
from engine.quantization.block_tuning import BlockTuningOptions
from engine.quantization.layerwise import LayerwiseInputs, quantize_layers
from engine.weights.loader import open_model_source
from engine.quantization.lora import load_adapter
from engine.quantization.float_source import FloatSource
from engine.quantization.report import QuantizeReport, TensorRecord, peak_rss_bytes, predict_peak, return_freed_memory
from engine.quantization.rotation import Rotation, plan_rotation, rotated_config
from engine.sources.tokenizer import Tokenizer
from quant import recipe as recipes
from quant.checkpoint import Checkpoint, CheckpointWriter
from quant.formats import CODE_RANGE, QuantSpec

METHODS = ("rtn", "gptq", "gsq")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")
QUALITY_FILE = "quality.json"
# `bonsai quantize`'s block tuning for gptq / gsq (the library's QuantizeOptions keep 0: off): Adam steps per layer
# (Qwen2.5-Coder-0.5B / 1.5B: docs/quality.md, session 22), learning rate (session 26, 64 x 256 calibration tokens:
# 1e-2 took the 0.5B from 2.56x to 2.23x the source perplexity but the 1.5B from 2.09-2.13x to 2.20x)
BLOCK_TUNE_STEPS, BLOCK_TUNE_LR = 50, 5e-3
# `bonsai quantize`'s share of the float model's target in each layer's GPTQ fit (asymmetric calibration, gptq / gsq;
# docs/quality.md, session 27: the 0.5B seed command 2.56x -> 1.92x at 0.25, 2.10x at 1)
ASYMMETRIC = 0.25
EVAL_CONTEXT = 512
MIN_EVAL_TOKENS = 128
Progress = Callable[[str, int, int], None]  # (message, done, total)


@dataclass(frozen=True)
class QuantizeOptions:
    recipe: recipes.Recipe
    method: str = "rtn"
    calib: Path | None = None  # None: the built-in text (docstrings of Python's standard library)
    calib_samples: int = 32
    calib_seq_len: int = 256
    gsq_steps: int = 200  # learned-rounding steps per layer (method gsq)
    scale_refits: int = 1  # gptq / gsq: rounds of least-squares group scales (quant.gptq.gptq_with_refits)
    tune_steps: int = 0  # gptq / gsq: end-to-end scale tuning steps afterwards (engine.quantization.scale_tuning)
    tune_lr: float = 5e-4
    block_tune_steps: int = 0  # gptq / gsq: Adam steps of block-wise scale tuning per layer (engine.quantization.block_tuning)
    block_tune_lr: float = BLOCK_TUNE_LR
    asymmetric: float = 0.0  # gptq / gsq: share of the float model's target in each layer's fit (calibration)
    lora: Path | None = None
    gguf: Path | None = None
    allow_lossy_gguf: bool = False
    device: str = "cpu"
    force: bool = False
    rotate: bool = False  # fold the norms and a randomized Hadamard rotation of the residual stream
    online_hadamard: bool = True  # with rotate: also an online Hadamard on down_proj's input
    evaluate: bool = True  # score the checkpoint against the source on held-out text
    eval_text: Path | None = None  # None: Python's pydoc topics
    eval_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise BonsaiError(f"unknown method '{self.method}': use one of {', '.join(METHODS)}")
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise BonsaiError("--calib-samples must be >= 1 and --calib-seq-len >= 2")
        if self.gsq_steps < 1:
            raise BonsaiError(f"--gsq-steps must be >= 1, got {self.gsq_steps}")
        if self.scale_refits < 0:
            raise BonsaiError(f"--scale-refits must be >= 0, got {self.scale_refits}")
        if self.tune_steps < 0 or not self.tune_lr > 0:
            raise BonsaiError(f"--tune-scales must be >= 0 and --tune-lr > 0, got {self.tune_steps} and {self.tune_lr}")
        if self.block_tune_steps < 0 or not self.block_tune_lr > 0:
            raise BonsaiError(f"--block-tune-steps must be >= 0 and --block-tune-lr > 0, got {self.block_tune_steps} "
                              f"and {self.block_tune_lr}")
        if not 0 <= self.asymmetric <= 1:
            raise BonsaiError(f"--asymmetric must be between 0 and 1, got {self.asymmetric}")
        if self.asymmetric and self.method == "rtn":
            raise BonsaiError("--asymmetric fits layers on calibration text: use it with --method gptq or gsq")
        if self.block_tune_steps and self.method == "rtn":
            raise BonsaiError("--block-tune-steps trains on calibration text: use it with --method gptq or gsq")
        if self.tune_steps and self.method == "rtn":
            raise BonsaiError("--tune-scales trains on calibration text: use it with --method gptq or gsq")
        if self.eval_tokens < MIN_EVAL_TOKENS:
            raise BonsaiError(f"--eval-tokens must be at least {MIN_EVAL_TOKENS}, got {self.eval_tokens}")


def _check_paths(src: Path, out: Path, gguf: Path | None, force: bool) -> None:
    src, out = src.resolve(), out.resolve()
    for target, flag in ((out, "OUT"), (gguf.resolve() if gguf else None, "--gguf")):
        if target is None:
            continue
        if target == src or target in src.parents:
            raise BonsaiError(f"{flag} {target} would overwrite the source model: choose another path")
        if target.exists() and not force and not (flag == "--gguf" and out in target.parents):
            raise BonsaiError(f"{target} exists: pass --force to replace it")


def _tokenizer_files(source: Any) -> dict[str, Path | bytes]:
    if isinstance(source, GGUFFile):
        return {k: v.encode() for k, v in Tokenizer.from_gguf_metadata(source.metadata).hf_files().items()}
    files = {name: source.path / name for name in TOKENIZER_FILES if (source.path / name).is_file()}
    if "tokenizer.json" not in files:
        raise BonsaiError(f"{source.path} has no tokenizer.json: the checkpoint needs the model's tokenizer files")
    return files


def _tokenizer(source: Any) -> Tokenizer:
    return (Tokenizer.from_gguf_metadata(source.metadata) if isinstance(source, GGUFFile)
            else Tokenizer.from_hf_dir(source.path))


def calibration_windows(opts: QuantizeOptions, tokenizer: Tokenizer) -> list[list[int]]:
    """--calib-samples windows of --calib-seq-len tokens spread evenly over the calibration text (only
    the text they take is tokenized)."""
    if opts.calib is not None and not Path(opts.calib).is_file():
        raise BonsaiError(f"calibration text not found: {opts.calib}")
    text = read_eval_text(opts.calib) if opts.calib is not None else default_calibration_text()
    return spread_windows(text, tokenizer, opts.calib_samples, opts.calib_seq_len)


def spread_windows(text: str, tokenizer: Tokenizer, samples: int, seq_len: int) -> list[list[int]]:
    """Up to `samples` windows of `seq_len` tokens from places spread evenly over `text`."""
    from engine.quantization.calibration import calibration_sequences
    chars = 8 * seq_len
    if len(text) <= 2 * samples * chars:  # short: all of it
        return calibration_sequences(tokenizer.encode(text), samples, seq_len)
    out = []
    for i in range(samples):
        start, width = round(i * (len(text) - chars) / max(samples - 1, 1)), chars
        while len(ids := tokenizer.encode(text[start:start + width])) < seq_len and start + width < len(text):
            width *= 2
        if len(ids) >= seq_len:
            out.append(ids[:seq_len])
    return out


def leading_tokens(text: str, tokenizer: Tokenizer, count: int) -> list[int]:
    """The first `count` tokens of `text` (only as much of it tokenized as that takes)."""
    width = 8 * count
    while len(ids := tokenizer.encode(text[:width])) < count + 1 and width < len(text):
        width *= 2
    return ids[:count]


def _fits(source_type: str, target_type: str) -> bool:
    """Whether codes of source_type's grid are exactly representable on target_type's."""
    if target_type not in CODE_RANGE:
        return False
    lo, hi = {"tri": (-1, 1), "tri-dense": (-1, 1), "int4": (-7, 7), "int8": (-127, 127)}.get(source_type, (-1, 1))
    tlo, thi = CODE_RANGE[target_type]
    return tlo <= lo and hi <= thi and (target_type != "bin" or source_type == "bin")


def _plan_rotation(source: Any, config, opts: QuantizeOptions) -> Rotation | None:
    if not opts.rotate:
        return None
    if config.hybrid is not None:
        raise BonsaiError("--rotate is not supported for hybrid (Qwen3.5/3.6) models yet: quantize without --rotate")
    if getattr(source, "rotation", None):
        raise BonsaiError(f"{source.path} is already rotated (its metadata says bonsai.rotation): quantize it "
                          "without --rotate")
    return plan_rotation(config, online=opts.online_hadamard)


def quantize(src: Path, out: Path, opts: QuantizeOptions, progress: Progress = lambda m, d, t: None,
             announce: Callable[[dict[str, int]], None] = lambda parts: None) -> QuantizeReport:
    """Quantize `src` into the checkpoint directory `out` (and opts.gguf); nothing is left on error.
    `announce` receives the predicted peak memory (predict_peak's terms) before the work starts."""
    start, cpu_start = time.perf_counter(), time.process_time()
    return_freed_memory()
    src, out = Path(src), Path(out)
    _check_paths(src, out, opts.gguf, opts.force)
    source = open_model_source(src)
    config = source.model_config()
    if getattr(source, "prism", None) is not None:  # its weights read rotated inputs: a checkpoint would lose that
        raise BonsaiError(f"{src} holds PrismML's folded Hadamard rotation, which bonsai checkpoints do not "
                          "record: run the GGUF as it is (bonsai generate / serve) instead of quantizing it")
    rotation = _plan_rotation(source, config, opts)
    out_rotation = rotation.metadata() if rotation else getattr(source, "rotation", None)
    if opts.gguf is not None and out_rotation and out_rotation.get("down_proj_hadamard"):
        raise BonsaiError("--gguf: llama.cpp cannot apply the online Hadamard on down_proj of a rotated model: "
                          "add --no-online-hadamard (residual rotation only) or drop --gguf")
    out_config = rotated_config(config) if rotation else config
    adapter = load_adapter(opts.lora) if opts.lora else None
    floats = FloatSource(source, config, adapter, rotation)
    shapes = {hf_name(n): s for n, s in floats.shapes.items()}
    try:
        specs, fallbacks = recipes.plan_with_fallback(opts.recipe, shapes, config.num_layers)
    except ValueError as e:
        raise BonsaiError(str(e)) from None
    if adapter is not None:
        adapter.check_fits(shapes)
    if opts.gguf is not None and not opts.allow_lossy_gguf:
        _check_exportable(specs, shapes, out_config)
    tokenizer_files = _tokenizer_files(source)
    tokenizer = _tokenizer(source)
    calibrated = opts.method != "rtn"
    calib_ids = calibration_windows(opts, tokenizer) if calibrated else []
    eval_ids = []
    if opts.evaluate:
        eval_ids = windows_of(leading_tokens(read_eval_text(opts.eval_text), tokenizer, opts.eval_tokens),
                              EVAL_CONTEXT)
    head = specs.get("model.embed_tokens.weight" if floats.tied else "lm_head.weight")
    tuning = BlockTuningOptions(steps=opts.block_tune_steps, lr=opts.block_tune_lr)
    predicted = predict_peak(out_config, sum(len(s) for s in calib_ids), opts.recipe.default.group_size,
                             head is None or head.is_float,
                             tuning.batch_sequences * opts.calib_seq_len if tuning.steps and calib_ids else 0,
                             opts.asymmetric > 0, _calibration_options(opts).batch_sequences * opts.calib_seq_len)
    announce(predicted)
    report = QuantizeReport(out=out, method=opts.method, rotation=out_rotation, group_fallbacks=fallbacks,
                            settings=_settings(opts, calib_ids), predicted_peak_bytes=predicted["total"])
    writer = CheckpointWriter(out, force=opts.force, rotation=out_rotation)
    try:
        _write_files(writer, source, config, out_config, tokenizer_files)
        record = _recorder(report, shapes)
        if config.hybrid is not None and rotation is None:
            _write_mtp_head(source, config, writer, report)
        kept = _write_kept(source, config, specs, adapter, rotation, opts, writer, record)
        job = LayerwiseInputs(floats, out_config, specs, opts.method, _calibration_options(opts), calib_ids,
                              eval_ids, kept, rotation.down_block if rotation else
                              int((out_rotation or {}).get("down_proj_hadamard", 0)),
                              tuning)
        ref_states = quantize_layers(job, writer, record, progress)
        report.block_tuning = job.tuning_reports
        tmp = writer.finish()
        if opts.tune_steps:
            from engine.quantization.tuning import tune_checkpoint
            writer, report.scale_tuning = tune_checkpoint(writer, floats, out_config, job, opts, out_rotation,
                                                          lambda m: progress(m, 0, 0))
            tmp = writer.finish()
        if ref_states is not None:
            from engine.quantization.quality import evaluate_written
            result = evaluate_written(tmp, out_config, eval_ids, ref_states, floats, job.options.device,
                                      job.down_block, progress)
            report.quality = {**result.as_dict(), "text": str(opts.eval_text or "pydoc_data.topics"),
                              "context": EVAL_CONTEXT}
        if opts.gguf is not None:
            progress("writing the GGUF", 0, 0)
            inside = opts.gguf.resolve().parent == out.resolve()
            report.gguf = export_gguf(Checkpoint(tmp), tmp / opts.gguf.name if inside else opts.gguf, out_config,
                                      source_gguf=source if isinstance(source, GGUFFile) else None,
                                      tokenizer_dir=tmp, allow_lossy=opts.allow_lossy_gguf)
            if inside:
                report.gguf.path = opts.gguf
            if not report.gguf.lossless and ref_states is not None:  # what the lossy tensors cost, end to end
                from engine.quantization.quality import evaluate_written
                gguf_file = tmp / opts.gguf.name if inside else opts.gguf
                result = evaluate_written(gguf_file, out_config, eval_ids, ref_states, floats, opts.device,
                                          job.down_block, progress)
                report.gguf_quality = result.as_dict()
        report.seconds, report.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        report.peak_rss_bytes = peak_rss_bytes()
        if report.quality is not None:
            (tmp / QUALITY_FILE).write_text(json.dumps(_quality_file(report), indent=1))
        writer.commit()
    finally:
        if writer.tmp.exists():  # an error or an interruption: nothing is left behind
            writer.abort()
    return report


def _check_exportable(specs: dict[str, QuantSpec], shapes: dict[str, tuple[int, ...]], config) -> None:
    """Refuse --gguf before any work when some tensor would have no llama.cpp type holding it exactly
    (a hybrid's too, where the V-head reorder would split its scale groups)."""
    from engine.quantization.gguf_export import lossy_message, packed_export_type
    lossy = []
    for name, spec in specs.items():
        if not spec.is_float:
            _, how = packed_export_type(name, spec.quant_type, shapes[name][1], spec.group_size, config)
            if how is not None:
                lossy.append((name, how))
    if lossy:
        raise BonsaiError(lossy_message(lossy))


def _settings(opts: QuantizeOptions, calib_ids: list[list[int]]) -> dict[str, Any]:
    return {"method": opts.method, "rotate": opts.rotate, "online_hadamard": opts.rotate and opts.online_hadamard,
            "scale_refits": opts.scale_refits if opts.method != "rtn" else 0,
            "gsq_steps": opts.gsq_steps if opts.method == "gsq" else 0, "tune_steps": opts.tune_steps,
            "block_tune_steps": opts.block_tune_steps, "block_tune_lr": opts.block_tune_lr,
            "asymmetric": opts.asymmetric,
            "calibration_tokens": sum(len(s) for s in calib_ids), "calibration_sequences": len(calib_ids),
            "calibration_text": str(opts.calib) if opts.calib else ("python stdlib docstrings" if calib_ids else None),
            "device": opts.device, "threads": torch.get_num_threads()}


def _quality_file(report: QuantizeReport) -> dict[str, Any]:
    return {"quality": report.quality, "settings": report.settings, "bits_per_weight": report.bits_per_weight,
            "seconds": report.seconds, "cpu_seconds": report.cpu_seconds, "peak_rss_bytes": report.peak_rss_bytes}


def _calibration_options(opts: QuantizeOptions):
    from engine.quantization.calibration import CalibrationOptions
    from quant.gsq import GSQOptions
    return CalibrationOptions(samples=opts.calib_samples, seq_len=opts.calib_seq_len, scale_refits=opts.scale_refits,
                              asymmetric=opts.asymmetric, device=opts.device, gsq=GSQOptions(steps=opts.gsq_steps))


def _write_files(writer: CheckpointWriter, source: Any, config, out_config, tokenizer_files) -> None:
    config_json = source.path / "config.json" if not isinstance(source, GGUFFile) else None
    if config_json is not None and out_config == config:
        writer.copy_file("config.json", config_json)
    elif config_json is not None:  # rotated: the same config, untied
        untied = {**json.loads(config_json.read_text()), "tie_word_embeddings": False}
        writer.add_file("config.json", json.dumps(untied, indent=2).encode())
    else:
        writer.add_file("config.json", json.dumps(hf_config(out_config), indent=2).encode())
    for name, content in tokenizer_files.items():
        writer.copy_file(name, content) if isinstance(content, Path) else writer.add_file(name, content)


def _write_mtp_head(source: Any, config, writer: CheckpointWriter, report: QuantizeReport) -> None:
    """A Qwen3.5 / 3.6 source's own MTP head (the `--spec mtp` drafter) copied as bfloat16 `mtp.*` entries
    (not quantized: it only drafts, verification keeps the output exact). Not for a rotated model, whose
    hidden states the head was not trained on."""
    from engine.sources.mtp_source import iter_mtp_tensors
    for short, tensor in iter_mtp_tensors(source, config):
        name = "mtp." + (short if not short.startswith("layers.") else hf_name(short)[len("model."):])
        nbytes = writer.write_float(name, tensor, "bf16")
        report.mtp_head.append(TensorRecord(name, "bf16", tensor.numel(), nbytes))


def _recorder(report: QuantizeReport, shapes: dict[str, tuple[int, ...]]):
    def record(name: str, fmt: str, nbytes: int, err: tuple[float, float] = (0.0, 0.0), was_kept: bool = False):
        report.tensors.append(TensorRecord(name, fmt, int(torch.Size(shapes[name]).numel()), nbytes, *err, was_kept))
    return record


def _write_kept(source: Any, config, specs: dict[str, QuantSpec], adapter, rotation, opts: QuantizeOptions,
                writer: CheckpointWriter, record) -> frozenset[str]:
    """rtn of an unrotated source: write the tensors it stores as codes on a grid the plan allows, as they are."""
    if opts.method != "rtn" or rotation is not None or not hasattr(source, "iter_quantized_tensors"):
        return frozenset()
    kept = set()
    for canon, qtype, group, codes, scales in source.iter_quantized_tensors(config):
        name, spec = hf_name(canon), specs.get(hf_name(canon))
        if spec is None or spec.is_float or (adapter and name in adapter.pairs) or not _fits(qtype, spec.quant_type):
            continue
        try:
            keep = QuantSpec(spec.quant_type, group)
        except ValueError:
            continue
        nbytes = writer.write_quantized(name, keep, codes, scales)
        weight = (codes.float().reshape(codes.shape[0], -1, group) * scales[..., None]).reshape(codes.shape)
        record(name, f"{keep.quant_type} g{group}", nbytes, (0.0, float(weight.pow(2).sum())), was_kept=True)
        kept.add(name)
    return frozenset(kept)
