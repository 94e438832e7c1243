"""What `bonsai quantize` reports: tensors written, bits per weight, weight errors, the quality against the
source, time and memory; and the peak memory it predicts before it starts.

Peak memory of the layer loop (engine.quantization.layerwise), in bytes, T calibration tokens (0 for rtn), H hidden,
F FFN width, K the widest linear input (max(H, q_size, F)), b(K) 8 up to 8192 inputs else 4
(quant.gptq.hessian_dtype), L the parameters of one decoder layer, V×H the embedding:
  base                       ~0.5 GiB (Python, torch, the tokenizer; measured 0.49-0.51 with a 1 MB model)
  one layer in float32       4·L
  calibration activations    4·T·(3·H + F)   (the stream in and out, the attention residual, SwiGLU)
  then the larger of
    GPTQ on the widest input  4·b(K)·K² + 12·N·K  (Hessian, its factorization; the matrix, its
                                                    working copy and codes)
    the output layer          V·H·(1 + 2/G) + 4·256 MiB  (its codes and scales assembled, slices
                                                    of rows in float32; bf16: 2·V·H)
    block tuning (if on)      9·L + 4·S·(8·H + 4·F)·2  (the layer assembled from codes × scales, its
                                                    gradient, the codes; one minibatch of S tokens with
                                                    its gradients), and 8·T·H more activations (the float
                                                    model's stream and its next states)
  asymmetric calibration (if on) adds the float stream (8·T·H, as block tuning), to GPTQ the cross term of the
  widest input, 4·N·K (kept as W·D when N < K) or b(K)·K² (as D), and a fourth candidate for the larger: the
  widest input's sums, b(K)·K² + cross + 4·T·H + 8·F·H + 12·C·K (its Hessian and cross term, the float residual
  and gate/up copy its float inputs are recomputed from, one chunk of C tokens' differences and products)
A 27B-class model (H 5120, F 21504, 64 layers, T 8192): ~0.5 + 1.6 + 0.9 + max(11.1, 1.4) ≈ 14 GiB.
"""
from __future__ import annotations

import math
import ctypes
import resource
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.quantization.gguf_export import GGUFExportReport
from engine.sources.model_config import ModelConfig
from quant import recipe as recipes
from quant.gptq import REFIT_CHUNK_BYTES, hessian_dtype

BASE_BYTES = 2 ** 29  # 0.5 GiB
SLICE_BYTES = 256 << 20  # float32 bytes of one slice of rows of the embedding / output layer
# GPTQ of the output layer keeps several float32 copies of its slice (weights, errors, codes, refits):
# slices of this size keep that below one decoder layer's float32 bytes for the models we target
GPTQ_SLICE_BYTES = 32 << 20


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
    cpu_seconds: float = 0.0  # this process's CPU time (all threads): wall time on an idle machine ≈ it / threads
    peak_rss_bytes: int = 0
    predicted_peak_bytes: int = 0
    gguf: GGUFExportReport | None = None
    rotation: dict | None = None  # the checkpoint's bonsai.rotation metadata
    scale_tuning: dict | None = None  # engine.quantization.scale_tuning's report (held-out KL before / after)
    block_tuning: list[dict] = field(default_factory=list)  # engine.quantization.block_tuning's report of each layer
    quality: dict | None = None  # engine.quantization.quality's scores against the source (None: --no-eval)
    gguf_quality: dict | None = None  # the same for a lossy GGUF export (--allow-lossy-gguf)
    group_fallbacks: dict[int, list[str]] = field(default_factory=dict)  # group used → tensor classes
    settings: dict[str, Any] = field(default_factory=dict)  # the options that made it
    mtp_head: list[TensorRecord] = field(default_factory=list)  # the source's MTP head, copied (not in the totals)

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
                "cpu_seconds": self.cpu_seconds,
                "peak_rss_bytes": self.peak_rss_bytes, "predicted_peak_bytes": self.predicted_peak_bytes,
                "formats": self.by_format(), "rotation": self.rotation, "settings": self.settings,
                "relative_error": self.error_by_class(), "kept_from_source": sum(t.kept for t in self.tensors),
                "group_fallbacks": {str(g): v for g, v in self.group_fallbacks.items()},
                "scale_tuning": self.scale_tuning, "block_tuning": self.block_tuning, "quality": self.quality, "gguf_quality": self.gguf_quality,
                "gguf": self.gguf.as_dict() if self.gguf else None,
                "mtp_head": {"tensors": len(self.mtp_head), "params": sum(t.params for t in self.mtp_head),
                             "bytes": sum(t.nbytes for t in self.mtp_head)} if self.mtp_head else None}


def return_freed_memory() -> None:
    """Make glibc's malloc give large freed blocks back to the system (mmap for >= 1 MiB, no dynamic
    threshold). By default glibc raises its mmap threshold up to 32 MiB after the first large free, so
    a layer's activations and GPTQ's matrices come from the heap, freed blocks stay resident and
    fragment: measured on a 222 MB model, peak RSS 1191 MiB with the default, 946 MiB with this.
    Process-wide, idempotent; a no-op where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 20)  # M_TRIM_THRESHOLD: give heap tops back past 1 MiB
    except (OSError, AttributeError):
        pass


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


def predict_peak(config: ModelConfig, calibration_tokens: int, group_size: int, head_float: bool,
                 tuning_tokens: int = 0, asymmetric: bool = False, chunk_tokens: int = 2048) -> dict[str, int]:
    """The terms of the module doc's formula, in bytes, and their 'total'. tuning_tokens: the tokens of one
    block-tuning minibatch (0: no block tuning); asymmetric: asymmetric calibration on; chunk_tokens: the tokens
    of one calibration forward pass."""
    h, f = config.hidden_size, config.intermediate_size
    shapes = config.linear_shapes()
    layer = sum(o * i for o, i in shapes.values())
    widest = max(shapes.values(), key=lambda s: (s[1], s[0]))
    n, k = widest
    b = 8 if hessian_dtype(k) != hessian_dtype(1 << 20) else 4
    refit = 2 * min(REFIT_CHUNK_BYTES, 4 * n * (k // group_size) * k)  # refit_scales' products of one chunk
    asymmetric = asymmetric and bool(calibration_tokens)
    cross = (4 * n * k if n < k else b * k * k) if asymmetric else 0  # the cross term W·D or D
    gptq = (4 * b * k * k + 12 * n * k + refit + cross) if calibration_tokens else 12 * n * k
    vh = config.vocab_size * h
    slice_bytes = min(GPTQ_SLICE_BYTES if calibration_tokens else SLICE_BYTES, 4 * vh)
    head = (2 * vh if head_float else int(vh * (1 + 2 / group_size))) + 4 * slice_bytes
    tuned = bool(tuning_tokens and calibration_tokens)
    parts = {"base": BASE_BYTES, "layer": 4 * layer,
             "activations": 4 * calibration_tokens * (3 * h + f + (2 * h if tuned or asymmetric else 0)),
             "gptq": gptq, "output layer": head,
             "block tuning": 9 * layer + 8 * tuning_tokens * (8 * h + 4 * f) if tuned else 0,
             "asymmetric": (b * k * k + cross + 4 * calibration_tokens * h + 8 * f * h + 12 * chunk_tokens * k
                            if asymmetric else 0)}
    parts["total"] = (parts["base"] + parts["layer"] + parts["activations"]
                      + max(parts["gptq"], parts["output layer"], parts["block tuning"], parts["asymmetric"]))
    return parts
