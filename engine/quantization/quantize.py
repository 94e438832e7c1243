"""`bonsai quantize`: a source model (HF dir, GGUF, bonsai checkpoint) → a bonsai checkpoint.

rtn works tensor by tensor: read one weight, merge the LoRA update, round, write, forget. gptq/gsq
hand the loaded model, the calibration tokens and the plan to engine.calibration. Tensors that a
GGUF or checkpoint already holds as codes on a grid the plan allows are kept, not requantized.
`rotate` folds the norms and a Hadamard rotation into the float weights first (engine.rotation),
tensor by tensor too, before any method sees them (GPTQ calibrates the rotated model).
Everything is written to a temporary directory renamed at the end; the report says per type the
tensors, parameters and bits per weight, and the relative weight error per tensor class.
"""
from __future__ import annotations

import json
import math
import resource
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from engine.sources.checkpoint_file import canonical_name, hf_config, hf_name
from engine.errors import BonsaiError, ModelFileError
from engine.quantization.evaluate import read_eval_text
from engine.sources.gguf_file import GGUFFile
from engine.sources.gguf_file import canonical_name as gguf_canonical_name
from engine.quantization.gguf_export import GGUFExportReport, export_gguf
from engine.sources.hf_files import HFModelDir
from engine.weights.loader import LoadedModel, expected_tensor_names, model_from_tensors, open_model_source, summarize
from engine.quantization.lora import LoraAdapter, load_adapter
from engine.sources.model_config import ModelConfig
from engine.quantization.rotation import Rotation, norm_names, plan_rotation, rotate_tensors, rotated_config
from engine.sources.tokenizer import Tokenizer
from quant import recipe as recipes
from quant.checkpoint import Checkpoint, CheckpointError, CheckpointWriter, SafetensorsFile
from quant.formats import CODE_RANGE, QuantSpec, quantize_rtn, relative_error, rounding_error

METHODS = ("rtn", "gptq", "gsq")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")
Progress = Callable[[str, int, int], None]  # (message, done, total)


@dataclass(frozen=True)
class QuantizeOptions:
    recipe: recipes.Recipe
    method: str = "rtn"
    calib: Path | None = None
    calib_samples: int = 128
    calib_seq_len: int = 512
    gsq_steps: int = 200  # learned-rounding steps per layer (method gsq)
    scale_refits: int = 1  # gptq / gsq: rounds of least-squares group scales (quant.gptq.gptq_with_refits)
    tune_steps: int = 0  # gptq / gsq: end-to-end scale tuning steps afterwards (engine.scale_tuning)
    tune_lr: float = 5e-4
    lora: Path | None = None
    gguf: Path | None = None
    device: str = "cpu"
    force: bool = False
    rotate: bool = False  # fold the norms and a randomized Hadamard rotation of the residual stream
    online_hadamard: bool = True  # with rotate: also an online Hadamard on down_proj's input

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
        if self.tune_steps and self.method == "rtn":
            raise BonsaiError("--tune-scales trains on calibration text: use it with --method gptq or gsq and --calib")


@dataclass
class TensorRecord:
    name: str
    format: str  # "tri g64", "bf16", "f32"
    params: int
    nbytes: int
    err_sq: float = 0.0
    ref_sq: float = 0.0
    kept: bool = False  # codes taken from the source as they were


@dataclass
class QuantizeReport:
    out: Path
    method: str
    tensors: list[TensorRecord] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    gguf: GGUFExportReport | None = None
    rotation: dict | None = None  # the checkpoint's bonsai.rotation metadata
    scale_tuning: dict | None = None  # engine.scale_tuning's report (held-out KL before / after)

    @property
    def params(self) -> int:
        return sum(t.params for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / max(self.params, 1)

    def by_format(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"tensors": 0, "params": 0, "bytes": 0})
        for t in self.tensors:
            row = out[t.format]
            row["tensors"] += 1
            row["params"] += t.params
            row["bytes"] += t.nbytes
        return {k: {**v, "bits_per_weight": 8 * v["bytes"] / max(v["params"], 1)} for k, v in out.items()}

    def error_by_class(self) -> dict[str, float]:
        """Relative Frobenius error ‖W - Ŵ‖ / ‖W‖ per tensor class (self_attn.q_proj, embed_tokens...)."""
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for t in self.tensors:
            if t.ref_sq > 0:
                s = sums[recipes.layer_kind(t.name)]
                s[0] += t.err_sq
                s[1] += t.ref_sq
        return {k: math.sqrt(e / r) for k, (e, r) in sums.items()}

    def as_dict(self) -> dict[str, Any]:
        return {"out": str(self.out), "method": self.method, "tensors": len(self.tensors), "parameters": self.params,
                "bytes": self.nbytes, "bits_per_weight": self.bits_per_weight, "seconds": self.seconds,
                "peak_rss_bytes": self.peak_rss_bytes, "formats": self.by_format(), "rotation": self.rotation,
                "relative_error": self.error_by_class(), "kept_from_source": sum(t.kept for t in self.tensors),
                "scale_tuning": self.scale_tuning, "gguf": self.gguf.as_dict() if self.gguf else None}


def _check_paths(src: Path, out: Path, gguf: Path | None, force: bool) -> None:
    src, out = src.resolve(), out.resolve()
    for target, flag in ((out, "OUT"), (gguf.resolve() if gguf else None, "--gguf")):
        if target is None:
            continue
        if target == src or target in src.parents:
            raise BonsaiError(f"{flag} {target} would overwrite the source model: choose another path")
        if target.exists() and not force and not (flag == "--gguf" and out in target.parents):
            raise BonsaiError(f"{target} exists: pass --force to replace it")


def _source_shapes(source: Any, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name → shape of every tensor the model uses (a tied model's copy of the embedding dropped)."""
    shapes = {}
    for name, _, shape, _ in source.tensor_info():
        canon = gguf_canonical_name(name) if isinstance(source, GGUFFile) else canonical_name(name)
        if canon is None or (canon == "lm_head.weight" and config.tie_word_embeddings):
            continue
        shapes[hf_name(canon)] = tuple(shape)
    return shapes


def _iter_float(source: Any, config: ModelConfig, skip: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every source tensor not in `skip` (canonical names), one at a time.
    HF safetensors are read with plain reads (no memory map: RSS stays what we hold)."""
    if isinstance(source, HFModelDir):
        for file in source.weight_files:
            try:
                st = SafetensorsFile(file)
            except (CheckpointError, OSError) as e:
                raise ModelFileError(f"{file} is not a valid safetensors file ({e})") from None
            for name in st.entries:
                canon = canonical_name(name)
                if canon is not None and canon not in skip:
                    yield hf_name(canon), st.read(name)
        return
    for canon, tensor in source.iter_canonical_tensors(config, skip=skip):
        yield hf_name(canon), tensor


def _tokenizer_files(source: Any) -> dict[str, Path | bytes]:
    if isinstance(source, GGUFFile):
        return {k: v.encode() for k, v in Tokenizer.from_gguf_metadata(source.metadata).hf_files().items()}
    files = {name: source.path / name for name in TOKENIZER_FILES if (source.path / name).is_file()}
    if "tokenizer.json" not in files:
        raise BonsaiError(f"{source.path} has no tokenizer.json: the checkpoint needs the model's tokenizer files")
    return files


def _calibration_tokens(opts: QuantizeOptions, source: Any) -> list[list[int]]:
    if not Path(opts.calib).is_file():
        raise BonsaiError(f"calibration text not found: {opts.calib}")
    tokenizer = (Tokenizer.from_gguf_metadata(source.metadata) if isinstance(source, GGUFFile)
                 else Tokenizer.from_hf_dir(source.path))
    ids = tokenizer.encode(read_eval_text(opts.calib))
    n = min(opts.calib_samples, len(ids) // opts.calib_seq_len)
    if n == 0:
        raise BonsaiError(f"the calibration text has {len(ids)} tokens, fewer than --calib-seq-len "
                          f"{opts.calib_seq_len}: give more text or a shorter --calib-seq-len")
    return [ids[i * opts.calib_seq_len:(i + 1) * opts.calib_seq_len] for i in range(n)]


def _fits(source_type: str, target_type: str) -> bool:
    """Whether codes of source_type's grid are exactly representable on target_type's."""
    if target_type not in CODE_RANGE:
        return False
    lo, hi = {"tri": (-1, 1), "tri-dense": (-1, 1), "int4": (-7, 7), "int8": (-127, 127)}.get(source_type, (-1, 1))
    tlo, thi = CODE_RANGE[target_type]
    return tlo <= lo and hi <= thi and (target_type != "bin" or source_type == "bin")


def quantize(src: Path, out: Path, opts: QuantizeOptions, progress: Progress = lambda m, d, t: None) -> QuantizeReport:
    """Quantize `src` into the checkpoint directory `out` (and opts.gguf); nothing is left on error."""
    start = time.perf_counter()
    src, out = Path(src), Path(out)
    if opts.method != "rtn":
        if opts.calib is None:
            raise BonsaiError(f"--method {opts.method} needs calibration text: pass --calib FILE (UTF-8 prose, "
                              "not the text you evaluate on)")
    _check_paths(src, out, opts.gguf, opts.force)
    source = open_model_source(src)
    config = source.model_config()
    rotation = _plan_rotation(source, config, opts)
    out_rotation = rotation.metadata() if rotation else getattr(source, "rotation", None)
    if opts.gguf is not None and out_rotation and out_rotation.get("down_proj_hadamard"):
        raise BonsaiError("--gguf: llama.cpp cannot apply the online Hadamard on down_proj of a rotated model: "
                          "add --no-online-hadamard (residual rotation only) or drop --gguf")
    out_config = rotated_config(config) if rotation else config
    shapes = _source_shapes(source, config)
    if rotation is not None and config.tie_word_embeddings:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    try:
        specs = recipes.plan(opts.recipe, shapes, config.num_layers)
    except ValueError as e:
        raise BonsaiError(str(e)) from None
    adapter = load_adapter(opts.lora) if opts.lora else None
    if adapter is not None:
        adapter.check_fits(shapes)
    tokenizer_files = _tokenizer_files(source)
    calib_ids = _calibration_tokens(opts, source) if opts.method != "rtn" else None
    report = QuantizeReport(out=out, method=opts.method, rotation=out_rotation)
    floats = _float_stream(source, config, adapter, rotation)
    with CheckpointWriter(out, force=opts.force, rotation=out_rotation) as writer:
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
        _write_tensors(source, out_config, shapes, specs, (floats, adapter, rotation), opts, calib_ids, writer,
                       report, progress)
        tmp = writer.finish()
        if opts.gguf is not None:
            progress("writing the GGUF", len(shapes), len(shapes))
            inside = opts.gguf.resolve().parent == out.resolve()
            report.gguf = export_gguf(Checkpoint(tmp), tmp / opts.gguf.name if inside else opts.gguf, out_config,
                                      source_gguf=source if isinstance(source, GGUFFile) else None,
                                      tokenizer_dir=tmp)
            if inside:
                report.gguf.path = opts.gguf
        writer.commit()
    report.seconds = time.perf_counter() - start
    report.peak_rss_bytes = peak_rss_bytes()
    return report


def _plan_rotation(source: Any, config: ModelConfig, opts: QuantizeOptions) -> Rotation | None:
    if not opts.rotate:
        return None
    if getattr(source, "rotation", None):
        raise BonsaiError(f"{source.path} is already rotated (its metadata says bonsai.rotation): quantize it "
                          "without --rotate")
    return plan_rotation(config, online=opts.online_hadamard)


FloatStream = Callable[[frozenset], Iterator[tuple[str, torch.Tensor]]]


def _float_stream(source: Any, config: ModelConfig, adapter: LoraAdapter | None, rotation: Rotation | None
                  ) -> FloatStream:
    """skip → (HF name, float tensor) of the model to quantize: the source's, LoRA merged, rotated."""
    norms = None
    if rotation is not None:  # the norm weights first (small): every linear that reads a norm folds it
        others = frozenset(expected_tensor_names(config) - norm_names(config))
        norms = {canonical_name(n): w for n, w in _iter_float(source, config, others)}

    def stream(skip: frozenset = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        merged = ((n, adapter.merge(n, w) if adapter else w) for n, w in _iter_float(source, config, skip))
        return merged if rotation is None else rotate_tensors(merged, config, rotation, norms)
    return stream


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM on Linux (ru_maxrss would include the RSS of the
    process that forked us, which Linux carries across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _write_tensors(source: Any, config: ModelConfig, shapes: dict[str, tuple[int, ...]],
                   specs: dict[str, QuantSpec], inputs: tuple[FloatStream, LoraAdapter | None, Rotation | None],
                   opts: QuantizeOptions, calib_ids: list[list[int]] | None, writer: CheckpointWriter,
                   report: QuantizeReport, progress: Progress) -> None:
    """config: the architecture written (untied when rotated); inputs: the stream of the float tensors
    to quantize (LoRA merged, rotated), the adapter and the rotation it applies."""
    floats, adapter, rotation = inputs
    total, kept = len(shapes), set()

    def record(name: str, fmt: str, nbytes: int, err: tuple[float, float] = (0.0, 0.0), was_kept: bool = False):
        report.tensors.append(TensorRecord(name, fmt, int(torch.Size(shapes[name]).numel()), nbytes, *err, was_kept))
        progress(name, len(report.tensors), total)

    if opts.method == "rtn" and hasattr(source, "iter_quantized_tensors") and rotation is None:
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
            kept.add(canon)
    pending = set()
    for name, w in floats(frozenset(kept)):
        if name not in shapes:
            continue
        spec = specs.get(name)
        if spec is None:
            record(name, "f32", writer.write_float(name, w, "f32"))
        elif spec.is_float:
            record(name, "bf16", writer.write_float(name, w, "bf16"), rounding_error(w, torch.bfloat16))
        elif opts.method == "rtn":
            try:
                codes, scales = quantize_rtn(spec, w.float())
            except ValueError as e:
                raise BonsaiError(f"{name}: {e}") from None
            nbytes = writer.write_quantized(name, spec, codes, scales)
            record(name, f"{spec.quant_type} g{spec.group_size}", nbytes,
                   relative_error(w, codes, scales, spec.group_size))
        else:
            pending.add(name)
    if pending:
        tuning = _write_calibrated(source, config, specs, inputs, opts, calib_ids or [], writer, record, pending,
                                   lambda message: progress(message, len(report.tensors), total))
        report.scale_tuning = asdict(tuning) if tuning is not None else None


def _float_model(source: Any, config: ModelConfig, inputs: tuple[FloatStream, LoraAdapter | None, Rotation | None],
                 opts: QuantizeOptions) -> LoadedModel:
    """The float32 model that calibration quantizes (LoRA merged, rotated) on opts.device."""
    from engine.weights.loader import load_model, resolve_device
    floats, adapter, rotation = inputs
    if rotation is None:
        loaded = load_model(source.path, device=opts.device, dtype=torch.float32, weight_dtype=torch.float32)
    else:
        dev = resolve_device(opts.device)
        model = model_from_tensors(config, ((canonical_name(n), w) for n, w in floats(frozenset())), dev,
                                   torch.float32, torch.float32, source.path, down_hadamard=rotation.down_block)
        loaded = LoadedModel(model, None, config, source.path, summarize(source), dev, torch.float32, torch.float32)
    if adapter is not None and rotation is None:  # (a rotated model was built from the merged weights)
        for name, w in _iter_float(source, config, frozenset()):
            if name in adapter.pairs:
                loaded.model.load_tensor(canonical_name(name), adapter.merge(name, w).float())
    return loaded


def _write_calibrated(source: Any, config: ModelConfig, specs: dict[str, QuantSpec],
                      inputs: tuple[FloatStream, LoraAdapter | None, Rotation | None], opts: QuantizeOptions,
                      calib_ids: list[list[int]], writer: CheckpointWriter, record: Callable, pending: set[str],
                      message: Callable[[str], None]):
    """gptq / gsq through engine.calibration, then (tune_steps > 0) end-to-end scale tuning against a
    second float copy of the model, then the errors. Returns the tuning's report or None."""
    from engine.quantization import calibration
    from engine.quantization.scale_tuning import ScaleTuningOptions, tune_scales
    from quant.gsq import GSQOptions
    floats = inputs[0]
    loaded = _float_model(source, config, inputs, opts)
    options = calibration.CalibrationOptions(samples=opts.calib_samples, seq_len=opts.calib_seq_len,
                                             scale_refits=opts.scale_refits, device=opts.device,
                                             gsq=GSQOptions(steps=opts.gsq_steps))
    quantized = {}
    for name, codes, scales, spec in calibration.quantize_with_calibration(
            loaded, calib_ids, recipes.calibration_plan(specs), opts.method, options, progress=message):
        codes, scales = codes.cpu(), scales.cpu()  # kept for the error report; written now unless tuned later
        quantized[name] = (codes, scales, spec, None if opts.tune_steps else writer.write_quantized(name, spec, codes, scales))
    tuning = None
    if opts.tune_steps:
        teacher = _float_model(source, config, inputs, opts)
        sequences = [list(s[:opts.calib_seq_len]) for s in calib_ids[:opts.calib_samples]]
        tuned, tuning = tune_scales(loaded.model, teacher.model, sequences, {n: q[:3] for n, q in quantized.items()},
                                    ScaleTuningOptions(steps=opts.tune_steps, lr=opts.tune_lr), loaded.device, message)
        del teacher
        quantized = {name: (codes, tuned[name], spec, writer.write_quantized(name, spec, codes, tuned[name]))
                     for name, (codes, _, spec, _) in quantized.items()}
    del loaded
    missing = pending - set(quantized)
    if missing:
        raise BonsaiError(f"calibration returned no codes for {sorted(missing)[0]} ({len(missing)} tensors)")
    for name, w in floats(frozenset()):
        if name in quantized:
            codes, scales, spec, nbytes = quantized.pop(name)
            record(name, f"{spec.quant_type} g{spec.group_size}", nbytes, relative_error(w, codes, scales, spec.group_size))
    return tuning

