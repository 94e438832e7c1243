"""The run config: what one run of a model is (model, runtime, memory, speculative, thinking and
context sections), as dataclasses validated on construction. A serve.yaml builds it (YAML is read
only by bonsai_cli; the server adds its own `server:` section, engine/server/config.py), and so do
the flags of generate, chat and bench (bonsai_cli/run_options.py): the same keys, the same checks.
`engine.run.builder.open_run` turns it into a running model.

Every key that is accepted does what it says. An unknown key is an error naming the nearest valid
key; a wrong type or an impossible value is an error with the key's path. Several devices
(`runtime.device: cuda:0,cuda:1`) run the model pipelined across them and need
`memory.pipeline_parallel: true` (engine/pipeline); the devices themselves are checked against the
machine before loading, not here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import BonsaiError
from engine.pipeline.devices import check_pipeline_drafters, check_pipeline_request
from engine.run.config_keys import build, fail, parse_bytes  # noqa: F401 - fail, parse_bytes: also this module's API
from engine.speculative.config import SpeculativeConfig
from engine.weights.formats import GROUP_SIZES, TERNARY_LAYOUTS, WEIGHT_TYPES, WeightFormat
from quant.formats import BITS_TO_TYPE
from quant.kv_format import KV_TYPES

WEIGHT_DTYPES = ("auto", "float32", "float16", "bfloat16")
OUTPUT_DTYPES = ("auto", "float32", "float16", "int8")
CPU_KERNELS = ("auto", "native", "torch")
DECODE_ALGORITHMS = ("standard", "speculative")


@dataclass(frozen=True)
class ModelSection:
    path: str
    quant_type: str = "bf16"  # run-time format of the block matrices (a bonsai checkpoint's own codes are kept)
    group_size: int = 128
    head_type: str = "bf16"  # run-time format of the output layer (int4: a quarter of a bf16 head's bytes)
    max_context: int | None = None  # tokens one conversation may use (≤ runtime.max_seq_len)
    kv_cache_quant: bool | None = None  # the users' seed keys: true + kv_cache_bits 8 | 4 → int8 | int4
    kv_cache_bits: int | None = None
    kv_type: str | None = None  # bf16 | int8 | int4 | k8v4 (quant/kv_format.py); default bf16
    kv_cache_async_dequant: bool = False
    chat_template: str | None = None  # a .jinja file replacing the model's own template
    name: str | None = None  # the model id /v1/models lists (default: the file or directory name)
    load_format: str = "auto"  # auto | dummy: path is an architecture YAML, random weights (speed work)
    tokenizer: str | None = None  # with dummy: the model (path or pulled name) whose tokenizer to use (text)
    sensitive_layers: str | None = None  # comma-separated names or regexes kept at sensitive_bits (as quantize's flag)
    sensitive_bits: int = 4
    ternary_layout: str = "auto"  # auto | 2bit | base3 (engine.weights.formats.WeightFormat)

    def __post_init__(self) -> None:
        if not self.path:
            fail("model.path", "is empty; give a model path or a pulled name such as smollm2-135m")
        if self.quant_type not in WEIGHT_TYPES:
            fail("model.quant_type", f"'{self.quant_type}' is not one of {', '.join(WEIGHT_TYPES)}")
        if self.head_type not in WEIGHT_TYPES:
            fail("model.head_type", f"'{self.head_type}' is not one of {', '.join(WEIGHT_TYPES)}")
        if self.group_size not in GROUP_SIZES:
            fail("model.group_size", f"{self.group_size} is not one of {', '.join(map(str, GROUP_SIZES))}")
        if self.max_context is not None and self.max_context < 2:
            fail("model.max_context", f"must be >= 2, got {self.max_context}")
        if self.load_format not in ("auto", "dummy"):
            fail("model.load_format", f"'{self.load_format}' is not auto or dummy")
        if self.load_format != "dummy" and self.tokenizer:
            fail("model.tokenizer", "only applies with load_format: dummy; remove it")
        if self.sensitive_bits not in BITS_TO_TYPE:
            fail("model.sensitive_bits", f"must be one of {', '.join(map(str, BITS_TO_TYPE))}, got {self.sensitive_bits}")
        self.kv_type_name  # noqa: B018 — validates the KV keys together
        if self.ternary_layout not in TERNARY_LAYOUTS:
            fail("model.ternary_layout", f"'{self.ternary_layout}' is not one of {', '.join(TERNARY_LAYOUTS)}")
        try:
            self.weight_format  # noqa: B018 — the patterns
        except BonsaiError as e:
            fail("model.sensitive_layers", str(e))
        if self.kv_cache_async_dequant:
            fail("model.kv_cache_async_dequant", "has nothing to overlap: decode attention reads the quantized KV "
                  "cache directly (dequantized in registers, tile by tile); set it to false")

    @property
    def weight_format(self) -> WeightFormat:
        """The run-time format asked for (engine.weights.formats: which layer gets which format)."""
        patterns = tuple(p.strip() for p in (self.sensitive_layers or "").split(",") if p.strip())
        return WeightFormat(self.quant_type, self.group_size, self.head_type, patterns,
                            BITS_TO_TYPE[self.sensitive_bits], self.ternary_layout)

    @property
    def kv_type_name(self) -> str:
        """The KV cache's element type from model.kv_type and/or the seed keys kv_cache_quant + kv_cache_bits."""
        if self.kv_type is not None and self.kv_type not in KV_TYPES:
            fail("model.kv_type", f"'{self.kv_type}' is not one of {', '.join(KV_TYPES)}")
        if self.kv_cache_bits is not None and not self.kv_cache_quant:
            fail("model.kv_cache_bits", "only applies with model.kv_cache_quant: true; remove it")
        if self.kv_cache_bits is not None and self.kv_cache_bits not in (8, 4):
            fail("model.kv_cache_bits", f"must be 8 or 4, got {self.kv_cache_bits}")
        by_bits = {8: "int8", 4: "int4"}.get(self.kv_cache_bits)
        if self.kv_type is None:
            if self.kv_cache_quant and by_bits is None:
                fail("model.kv_cache_bits", "is required with model.kv_cache_quant: true (8 or 4), "
                      "or give model.kv_type")
            return by_bits or "bf16"
        quantized = KV_TYPES[self.kv_type].quantized
        if self.kv_cache_quant is not None and self.kv_cache_quant != quantized:
            fail("model.kv_cache_quant", f"{str(self.kv_cache_quant).lower()} contradicts model.kv_type: "
                  f"{self.kv_type}; remove one of them")
        if by_bits is not None and by_bits != self.kv_type:
            fail("model.kv_cache_bits", f"{self.kv_cache_bits} contradicts model.kv_type: {self.kv_type}; "
                  "remove one of them")
        return self.kv_type


@dataclass(frozen=True)
class RuntimeSection:
    device: str = "cpu"
    max_batch_size: int = 1  # slots: requests decoded together in one batched step
    max_seq_len: int | None = None  # KV positions allocated per slot (default: max_context, else 4096)
    prefill_chunk_size: int | None = None  # default 512, smaller when memory.max_gpu_memory needs it
    decode_algorithm: str = "standard"
    draft_model: str | None = None  # "none": draftless (n-gram) speculation; a path: a draft model
    weight_dtype: str = "auto"  # auto: on the CPU float16 for one slot (gemv; bfloat16 beside cpu_int4's 4-bit
    # matrices where the CPU has bf16 GEMM: engine.weights.loader.default_weight_dtype), float32 for several (GEMM)
    # on the CPU, a GGUF's Q4_0/Q4_1/Q4_K (Q5_0/Q5_1/Q8_0: two halves) matrices run as stored (int4 kernel, bfloat16
    # activations); default (None): when weight_dtype is auto and model.quant_type bf16 (as loaded)
    cpu_int4: bool | None = None
    # the CPU output layer: float32 (exact), float16 (one float16 GEMM, the top logits recomputed exactly:
    # engine.runtime.narrow_head), int8 (one int8-weight GEMM, the same recomputation; float16 on CPUs without
    # AVX512); auto: int8 when weight_dtype is auto and the device the CPU
    output_dtype: str = "auto"
    # which kernels run the block matrices on the CPU: native (bonsai's, compiled with the machine's C compiler:
    # every GGUF block type at its stored size, int8 activations), torch (torch's int4 kernel, bfloat16
    # activations), auto (native where its AVX512-VNNI or AVX2 bodies compile, else torch; engine.weights.cpu_int4_load)
    cpu_kernels: str = "auto"

    @property
    def devices(self) -> list[str]:
        """The listed devices: one, or the stages of a pipeline (memory.pipeline_parallel)."""
        return [d.strip() for d in self.device.split(",") if d.strip()]

    @property
    def first_device(self) -> str:
        """The device of rank 0 (the only one without a pipeline)."""
        return self.devices[0]

    def __post_init__(self) -> None:
        devices = self.devices
        if not devices or any(not (d == "cpu" or d.split(":")[0] == "cuda") for d in devices):
            fail("runtime.device", f"'{self.device}' is not cpu, cuda or cuda:N (or a list: cuda:0,cuda:1)")
        if not 1 <= self.max_batch_size <= 64:
            fail("runtime.max_batch_size", f"must be in 1..64, got {self.max_batch_size}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            fail("runtime.max_seq_len", f"must be >= 2, got {self.max_seq_len}")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            fail("runtime.prefill_chunk_size", f"must be >= 1, got {self.prefill_chunk_size}")
        if self.decode_algorithm not in DECODE_ALGORITHMS:
            fail("runtime.decode_algorithm", f"'{self.decode_algorithm}' is not one of {', '.join(DECODE_ALGORITHMS)}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            fail("runtime.weight_dtype", f"'{self.weight_dtype}' is not one of {', '.join(WEIGHT_DTYPES)}")
        if self.cpu_int4 and any(d != "cpu" for d in devices):
            fail("runtime.cpu_int4", f"applies to the CPU only, the device is {self.device}; remove it")
        if self.cpu_kernels not in CPU_KERNELS:
            fail("runtime.cpu_kernels", f"'{self.cpu_kernels}' is not one of {', '.join(CPU_KERNELS)}")
        if self.output_dtype not in OUTPUT_DTYPES:
            fail("runtime.output_dtype", f"'{self.output_dtype}' is not one of {', '.join(OUTPUT_DTYPES)}")
        if self.output_dtype in ("float16", "int8") and any(d != "cpu" for d in devices):
            fail("runtime.output_dtype", f"{self.output_dtype} applies to the CPU only, the device is {self.device}; "
                 "use auto")
        if self.draft_model is not None and self.decode_algorithm != "speculative":
            fail("runtime.draft_model", "only applies with runtime.decode_algorithm: speculative; remove it")


@dataclass(frozen=True)
class MemorySection:
    # blocks' weights in pinned host RAM, streamed in per pass (embedding on the host): false never; auto only the
    # blocks max_gpu_memory cannot hold (the memory plan picks them); true every block (engine.memory.streaming)
    weight_offload: bool | str = False
    activation_checkpoint: bool = False
    max_gpu_memory: str | None = None
    pipeline_parallel: bool = False
    kv_offload: bool = False  # the KV pool in pinned host RAM, each layer's rows streamed in ahead of use
    host_kv_mib: int | None = None  # host memory granted to the offloaded KV pool (default: what it needs)
    # the embedding table in host memory, the decode step still CUDA-graphed (default: when max_gpu_memory needs it)
    embedding_on_host: bool | None = None

    @property
    def max_gpu_memory_bytes(self) -> int | None:
        """The hard limit on the device's allocator: planned before loading (engine.run.plan),
        enforced while running (engine.memory.limit)."""
        return None if self.max_gpu_memory is None else parse_bytes(self.max_gpu_memory, "memory.max_gpu_memory")

    def __post_init__(self) -> None:
        if self.host_kv_mib is not None:
            if not self.kv_offload:
                fail("memory.host_kv_mib", "only applies with memory.kv_offload: true; remove it")
            if self.host_kv_mib < 1:
                fail("memory.host_kv_mib", f"must be >= 1, got {self.host_kv_mib}")
        if not (isinstance(self.weight_offload, bool) or self.weight_offload == "auto"):
            fail("memory.weight_offload", f"must be false, auto (stream only the blocks max_gpu_memory cannot hold) "
                  f"or true (stream every block), got {self.weight_offload!r}")
        if self.weight_offload == "auto" and self.max_gpu_memory is None:
            fail("memory.weight_offload", "auto streams the blocks memory.max_gpu_memory cannot hold: set "
                  "memory.max_gpu_memory (or weight_offload: true to stream every block)")
        if self.weight_offload and self.embedding_on_host is False:
            fail("memory.embedding_on_host", f"false contradicts memory.weight_offload: {self.weight_offload}, which "
                  "keeps the table in host memory when it streams blocks; remove one of them")
        if self.activation_checkpoint:
            fail("memory.activation_checkpoint", "is a training option (inference keeps no activations); "
                  "set it to false")
        if self.max_gpu_memory is not None:
            parse_bytes(self.max_gpu_memory, "memory.max_gpu_memory")
        if self.pipeline_parallel and (self.weight_offload or self.kv_offload or self.embedding_on_host):
            key = ("weight_offload" if self.weight_offload else "kv_offload" if self.kv_offload
                   else "embedding_on_host")
            fail(f"memory.{key}", "is not available with memory.pipeline_parallel: the stages already share the "
                  "model across devices; set it to false (or list more devices)")


@dataclass(frozen=True)
class SpeculativeSection:
    """The drafters every slot runs when runtime.decode_algorithm is speculative: the fields of
    engine.speculative.config.SpeculativeConfig (method is a spec string as in `--spec`: ngram,
    draft:PATH, mtp:PATH, dflash:PATH, mix:ngram,draft:PATH). Without this section, runtime.draft_model
    decides: none (or absent) → ngram, a path → draft:PATH. Each slot owns its drafter instance (its
    n-gram tables or draft-model cache), begun on each request's whole prompt (reused prefix included);
    an n-gram pool (ngram_pool_size > 0) is shared by all slots."""
    method: str = "ngram"
    num_draft_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_pool_size: int = 0
    adaptive: bool = True
    draft_weights: str = "auto"  # a draft model's matrices on the CPU: auto (4-bit codes) or stored

    def __post_init__(self) -> None:
        try:
            self.as_spec_config()  # the one validation of these fields lives there
        except BonsaiError as e:
            raise BonsaiError(f"config speculative: {e}") from None

    def as_spec_config(self) -> SpeculativeConfig:
        return SpeculativeConfig.from_spec(self.method, num_draft_tokens=self.num_draft_tokens,
                                           ngram_min=self.ngram_min, ngram_max=self.ngram_max,
                                           ngram_pool_size=self.ngram_pool_size, adaptive=self.adaptive,
                                           draft_weights=self.draft_weights)


@dataclass(frozen=True)
class ThinkingSection:
    budget: int | None = None  # thinking tokens before the end tag is inserted (None: unlimited)
    end_message: str = ""  # text inserted before the end tag when the budget is spent
    start_tag: str = "<think>"
    end_tag: str = "</think>"

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 0:
            fail("thinking.budget", f"must be >= 0, got {self.budget}")
        if not self.start_tag or not self.end_tag or self.start_tag == self.end_tag:
            fail("thinking.start_tag", "start_tag and end_tag must be two different non-empty strings")


@dataclass(frozen=True)
class ContextSection:
    compress_at: float = 0.9  # drop the oldest turns only when the prompt passes this share of the context

    def __post_init__(self) -> None:
        if not 0 < self.compress_at <= 1:
            fail("context.compress_at", f"must be in (0, 1], got {self.compress_at}")


@dataclass(frozen=True)
class RunConfig:
    model: ModelSection
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    memory: MemorySection = field(default_factory=MemorySection)
    speculative: SpeculativeSection | None = None
    thinking: ThinkingSection = field(default_factory=ThinkingSection)
    context: ContextSection = field(default_factory=ContextSection)

    def __post_init__(self) -> None:
        rt, m = self.runtime, self.model
        for check in (lambda: check_pipeline_request(rt.device, self.memory.pipeline_parallel),
                      lambda: self.memory.pipeline_parallel and check_pipeline_drafters(self.spec_config)):
            try:
                check()
            except BonsaiError as e:
                raise BonsaiError(f"config {e}") from None
        if m.max_context is not None and rt.max_seq_len is not None and m.max_context > rt.max_seq_len:
            fail("model.max_context", f"{m.max_context} exceeds runtime.max_seq_len {rt.max_seq_len} "
                  "(the KV positions each slot has); lower it or raise max_seq_len")
        if self.speculative is not None and rt.decode_algorithm != "speculative":
            fail("speculative", "is set but runtime.decode_algorithm is standard; set decode_algorithm: "
                  "speculative or remove the section")
        if rt.decode_algorithm == "speculative" and self.speculative is not None:
            draft_member = any(d.method == "draft" for d in self.speculative.as_spec_config().drafters)
            if rt.draft_model not in (None, "none"):
                fail("runtime.draft_model", "and the speculative section both choose the drafters; put "
                      f"draft:{rt.draft_model} in speculative.method and remove runtime.draft_model")
            if rt.draft_model == "none" and draft_member:
                fail("speculative.method", f"'{self.speculative.method}' runs a draft model but runtime.draft_model "
                      "is none (draftless drafters only); remove draft_model: none or the draft: member")

    @property
    def spec_config(self) -> SpeculativeConfig | None:
        """The engine.speculative.config.SpeculativeConfig every slot drafts with (None: plain decoding).
        decode_algorithm speculative without a speculative section: draft_model none (or absent) →
        n-gram prompt lookup with the defaults; draft_model PATH → that draft model."""
        rt = self.runtime
        if rt.decode_algorithm != "speculative":
            return None
        if self.speculative is not None:
            return self.speculative.as_spec_config()
        method = "ngram" if rt.draft_model in (None, "none") else f"draft:{rt.draft_model}"
        return SpeculativeSection(method=method).as_spec_config()

    @property
    def slot_context(self) -> int:
        """Positions each slot's conversation may use."""
        return self.model.max_context or self.runtime.max_seq_len or 4096

    @property
    def seq_len(self) -> int:
        """KV positions allocated per slot."""
        return self.runtime.max_seq_len or self.slot_context

    def contexts(self, positions: int) -> tuple[int, int]:
        """(slot_context, seq_len) for a model of `positions` positions: as configured, or, when
        neither model.max_context nor runtime.max_seq_len is set, min(4096, positions)."""
        if self.model.max_context is None and self.runtime.max_seq_len is None:
            return (min(4096, positions),) * 2
        return self.slot_context, self.seq_len

    @property
    def weight_dtype(self):
        """runtime.weight_dtype as a torch dtype (None: the loader's default). On the CPU, auto picks
        float32 when several slots decode together: a batched float16 matmul widens the whole weight
        each step, float32 reads it once for every row."""
        name = self.runtime.weight_dtype
        if name == "auto":
            cpu = self.runtime.first_device == "cpu"
            return torch.float32 if cpu and self.runtime.max_batch_size > 1 else None
        return getattr(torch, name)

    @property
    def cpu_int4(self) -> bool:
        """Whether a GGUF's 4-bit block matrices run as stored on the CPU (runtime.cpu_int4; by default when
        the matrices' dtype and format are left to bonsai)."""
        rt = self.runtime
        if rt.cpu_int4 is not None:
            return rt.cpu_int4
        return rt.first_device == "cpu" and rt.weight_dtype == "auto" and self.model.quant_type == "bf16"

    @property
    def narrow_head(self) -> str | None:
        """The CPU output layer's fast GEMM, "float16" or "int8" with exact top logits, or None for float32
        (runtime.output_dtype)."""
        rt = self.runtime
        if rt.output_dtype != "auto":
            return None if rt.output_dtype == "float32" else rt.output_dtype
        return "int8" if rt.first_device == "cpu" and rt.weight_dtype == "auto" else None

    @classmethod
    def from_dict(cls, data: Any, ignore: tuple[str, ...] = ()) -> "RunConfig":
        """From a mapping of sections; `ignore`: sections another reader owns (a serve file's
        `server:` for the commands that do not serve), accepted and left out."""
        if isinstance(data, dict) and ignore:
            data = {k: v for k, v in data.items() if k not in ignore}
        return build(cls, data, "")
