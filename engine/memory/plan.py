"""The memory plan: every byte a run puts on its device, computed from shapes alone (no model loaded).

Inputs are the architecture (ModelConfig), the run-time format of every linear layer (float or a
packed layout, engine.weights.formats.linear_formats) and the run settings (context, slots, KV type, ...). Each line
mirrors an allocation of the code:
- weights: the parameters and buffers of `engine.runtime.model.Transformer` after loading / packing
  (engine.weights.loader, engine.weights.packed_load, engine.weights.packed_linear): float matrices in the weight dtype, the
  embedding, output layer, norms and biases in the compute dtype, packed matrices as int32 words
  [K/E, N] plus float16 scales [K/G, N], the rotary frequencies (float32 [D/2]);
- kv: engine.runtime.kv_cache.KVCache, `quant.kv_format.kv_bytes_per_token` per position of every slot;
- decode: per captured row count, the static inputs, split-K workspace and logits of
  engine.runtime.cuda_graphs.DecodeStepRunner plus its CUDA graph's private pool (the live intermediates of
  engine.runtime.decode_step at their peak, in the caching allocator's segments);
- prefill: the peak of live activations of one `Transformer.forward` chunk on a GPU (a packed layer
  of more than engine.weights.packed_linear.packed_rows_limit rows is unpacked to a float Wᵀ for cuBLAS, whole or in
  column slices of RunSettings.unpack_slice_bytes; chunks after the first attend through a mask, in query
  blocks whose float32 scores stay under engine.runtime.model.ATTENTION_SCORE_BYTES, counted as if PyTorch
  ran them in its float32 math backend);
- logits: the logits copies, the sampling temporaries of one step and each sequence's penalty counts;
- runtime: the cuBLAS / cuBLASLt workspaces (CUDA only; an estimate, not a shape).
Offloaded weights or KV (memory.weight_offload / kv_offload) leave the device except a staging ring of two
layers; their host bytes are listed apart (`host_lines`), and so is the embedding table kept in host memory
(memory.embedding_on_host: the decode step then takes the rows' embeddings as a static [M, H] input).
- load: loading makes each packed matrix in its final buffer, a slice at a time; the temporaries of
  one slice (engine.weights.packed_linear.quantize_transient, quant.packed_layout.random_packed_transient)
  come on top of the weights while nothing else is allocated: the line holds what of them the
  buffers allocated after loading do not cover (usually nothing);
- a quantized KV cache is calibrated once when the runner is built (engine.runtime.kv_calibration): a float cache of
  CALIBRATION_TOKENS positions and one pass next to the KV cache; the prefill line holds the larger of that and a chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import BonsaiError
from engine.kernels.deltanet_ref import prefill_scratch_bytes
from engine.memory.host_embedding import check_embedding_on_host
from engine.memory.allocator_segments import MIB, pool_segment_bytes, round_up, rounding_slack
from engine.memory.streaming import ring_bytes, streamed_blocks
from engine.runtime.hybrid_state import POINTS
from engine.runtime.model import attention_block_rows
from engine.sources.model_config import ModelConfig
from engine.weights.formats import LinearFormat, linear_modules
from engine.weights.packed_linear import packed_rows_limit, quantize_transient, unpack_columns
from quant.kv_format import KV_TYPES, kv_bytes_per_token
from quant.packed_layout import packed_nbytes, random_packed_transient

CUBLAS_WORKSPACES = 2 * 32 * MIB  # cuBLAS + cuBLASLt workspaces torch allocates on a Hopper GPU
SAMPLING_BYTES_PER_LOGIT = 44  # temperature, softmax, sort (values + int64 order), cumsum, masks, scatter
PENALTY_BYTES_PER_LOGIT = 8  # float32 prompt and output token counts of a sequence (repetition penalties)
STAGING_LAYERS = 2  # offloaded weights / KV keep a ring of this many layers on the device
CALIBRATION_TOKENS = 256  # engine.runtime.kv_calibration.CALIBRATION_TOKENS


@dataclass(frozen=True)
class PlanLine:
    category: str  # weights | kv | decode | prefill | logits | runtime | load | drafter
    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class RunSettings:
    max_seq_len: int  # KV positions per slot
    slots: int = 1
    prefill_chunk_size: int = 512
    kv_type: str = "bf16"  # quant.kv_format.KV_TYPES; "bf16" means the compute dtype's floats
    cuda: bool = True
    dtype_bytes: int = 2  # activations, norms, embedding, output layer, float KV (bf16 on CUDA, f32 on CPU)
    weight_dtype_bytes: int = 2  # float block matrices (float16 on the CPU by default)
    graph_rows: int = 1  # the fused decode step is built for 1..graph_rows rows (0: plain path only)
    num_splits: int = 1  # split-K of the decode attention kernel
    weight_offload: bool = False  # blocks streamed from host memory (engine.memory.streaming)
    resident_layers: tuple[int, ...] = ()  # with weight_offload: the blocks kept on the device (the rest stream)
    kv_offload: bool = False
    rotation_block: int = 0  # online Hadamard block of a rotated checkpoint (0: none)
    embedding_on_host: bool = False  # the embedding table in host memory (engine.memory.host_embedding)
    verify_positions: int = 0  # states a hybrid's verify pass keeps per slot for its rollback (k + 2; 0: no speculation)
    dummy: bool = False  # weights generated (load_format: dummy) rather than read: the load's temporaries
    unpack_slice_bytes: int = 0  # prefill's unpacked Wᵀ: whole (0) or in slices of this many bytes (packed_linear)

    @property
    def kv_label(self) -> str:
        """The KV element type as stored: a quantized type's name, else the compute dtype's."""
        if KV_TYPES[self.kv_type].quantized:
            return self.kv_type
        return {2: "bf16", 4: "f32"}.get(self.dtype_bytes, "float")

    def __post_init__(self) -> None:
        if self.kv_type not in KV_TYPES:
            raise BonsaiError(f"unknown KV type '{self.kv_type}': use one of {', '.join(KV_TYPES)}")
        if self.max_seq_len < 1 or self.slots < 1 or self.prefill_chunk_size < 1:
            raise BonsaiError("max_seq_len, slots and prefill_chunk_size must be >= 1")


@dataclass
class MemoryPlan:
    lines: list[PlanLine]
    host_lines: list[PlanLine] = field(default_factory=list)  # offloaded: in host RAM, not on the device

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    def category(self, name: str) -> int:
        return sum(line.bytes for line in self.lines if line.category == name)

    def categories(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in self.lines:
            out[line.category] = out.get(line.category, 0) + line.bytes
        return out

    def as_dict(self) -> dict:
        return {"total_bytes": self.total, "by_category": self.categories(),
                "lines": [vars(line) for line in self.lines],
                "host_bytes": sum(line.bytes for line in self.host_lines),
                "host_lines": [vars(line) for line in self.host_lines]}


def packed_bytes(fmt: LinearFormat, out_features: int, in_features: int) -> int:
    """int32 words [K/E, N] (tri5: 13 word rows per 256 inputs) + float16 scales [K/G, N]."""
    return packed_nbytes(fmt.kind, out_features, in_features, fmt.group_size)


def weight_tensors(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings
                   ) -> list[tuple[str, int | None, int]]:
    """(what, layer index or None, bytes) of every parameter and buffer of the loaded model."""
    d, h = s.dtype_bytes, config.hidden_size
    shapes = {path: (n, k) for path, n, k, _ in linear_modules(config)}
    shapes["lm_head"] = (config.vocab_size, h)
    out: list[tuple[str, int | None, int]] = [("embed", None, config.vocab_size * h * d), ("norm", None, h * d),
                                              ("inv_freq", None, config.head_dim // 2 * 4)]
    for path, fmt in formats.items():
        n, k = shapes[path]
        layer = int(path.split(".")[1]) if path.startswith("layers.") else None
        what = path.rsplit(".", 1)[-1]
        if fmt.packed:
            size = packed_bytes(fmt, n, k)
        else:  # the output layer keeps the compute dtype, block matrices the weight dtype
            size = n * k * (d if path == "lm_head" else s.weight_dtype_bytes)
        out.append((what, layer, size))
    for i in range(config.num_layers):
        if config.is_linear(i):  # DeltaNet: conv weights, dt_bias, A_log, its gated norm
            hc = config.hybrid
            out.append(("norms", i, (2 * h + hc.conv_dim * hc.conv_kernel + 2 * hc.linear_num_value_heads
                                     + hc.linear_value_head_dim) * d))
            continue
        out.append(("norms", i, (2 * h + (2 * config.head_dim if config.qk_norm else 0)) * d))
        if config.attention_bias:
            out.append(("bias", i, (config.q_size + 2 * config.kv_size) * d))
        if s.rotation_block:
            b1 = 1 << ((s.rotation_block.bit_length() - 1) // 2)
            out.append(("hadamard", i, (b1 * b1 + (s.rotation_block // b1) ** 2) * 4))
    return out


def _weight_lines(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings
                  ) -> tuple[list[PlanLine], list[PlanLine]]:
    tensors = weight_tensors(config, formats, s)
    labels = {path.rsplit(".", 1)[-1]: fmt.label for path, fmt in formats.items()}
    streamed = streamed_blocks(config.num_layers, s.weight_offload, s.resident_layers)
    groups: dict[tuple[str, bool], list[int]] = {}  # (what, streamed) → sizes
    for what, layer, size in tensors:
        groups.setdefault((what, layer in streamed), []).append(size)
    device, host = [], []
    layer_bytes = [0] * config.num_layers
    for what, layer, size in tensors:
        if layer is not None:
            layer_bytes[layer] += size
    table_may_leave = not config.tie_word_embeddings or "lm_head" in formats  # the streamer moves it then
    for (what, on_host), sizes in groups.items():
        label = labels.get(what, "")
        name = what + (f" ×{len(sizes)}" if len(sizes) > 1 else "") + (f" ({label})" if label else "")
        if on_host:
            host.append(PlanLine("weights", name, sum(sizes), "host RAM (weight_offload: streamed)"))
        elif s.weight_offload and what == "embed" and table_may_leave:
            host.append(PlanLine("weights", name, sum(sizes), "host RAM (weight_offload)"))
        elif s.embedding_on_host and what == "embed":
            host.append(PlanLine("weights", name, sum(sizes), "host RAM (embedding_on_host): each step's rows "
                                 "are copied in"))
        else:
            device.append(PlanLine("weights", name, sum(sizes)))
    if streamed:
        ring = ring_bytes(layer_bytes, streamed)
        device.append(PlanLine("weights", f"staging ring ({min(STAGING_LAYERS, len(streamed))} layers)", ring,
                               f"weight_offload: {len(streamed)} of {config.num_layers} blocks stream"))
        if s.cuda:  # a partial offload is planned to the last block: the segments' rounding counted too
            slack = sum(block_slack(config, formats, s)[i] for i in range(config.num_layers) if i not in streamed)
            device.append(PlanLine("weights", "allocator rounding of the resident blocks", slack,
                                   "estimate: each tensor over 1 MiB rounded up to 2 MiB"))
    return device, host


def block_slack(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings) -> list[int]:
    """Per block: the allocator's rounding of its tensors (allocator_segments.rounding_slack)."""
    sizes: list[list[int]] = [[] for _ in range(config.num_layers)]
    for _, layer, size in weight_tensors(config, formats, s):
        if layer is not None:
            sizes[layer].append(size)
    return [rounding_slack(x) for x in sizes]



def _kv_lines(config: ModelConfig, s: RunSettings) -> tuple[list[PlanLine], list[PlanLine]]:
    kv = KV_TYPES[s.kv_type]
    per_token = kv_bytes_per_token(kv, config.num_kv_layers, config.num_kv_heads, config.head_dim, s.dtype_bytes)
    total = per_token * s.max_seq_len * s.slots
    name = f"KV cache {s.kv_label} ({s.slots} × {s.max_seq_len} positions)"
    states, host = [], []
    if config.hybrid is not None:  # engine.runtime.hybrid_state: fp32 recurrent state + conv window per slot
        per_slot, n = config.hybrid.state_bytes_per_slot(s.dtype_bytes), s.slots
        states = [PlanLine("kv", f"DeltaNet states ({n} slots × {config.hybrid.counts()['linear_attention']} "
                                 "layers)", per_slot * n)]
        if s.verify_positions:  # every slot keeps the state after each position of its last verify pass
            states.append(PlanLine("kv", f"DeltaNet verify states ({n} slots × {s.verify_positions} positions)",
                                   per_slot * n * s.verify_positions))
        host = [PlanLine("kv", f"DeltaNet prefix points ({n} slots × {POINTS})", per_slot * n * POINTS, "host RAM")]
    if not s.kv_offload:
        return [PlanLine("kv", name, total)] + states, host
    ring = STAGING_LAYERS * total // config.num_kv_layers  # engine.memory.kv_offload: two layers' buffers
    return ([PlanLine("kv", f"KV staging ring ({STAGING_LAYERS} layers)", ring, "kv_offload")] + states,
            [PlanLine("kv", name, total, "host RAM (kv_offload)")] + host)


def decode_step_bytes(config: ModelConfig, formats: dict[str, LinearFormat], rows: int, s: RunSettings
                      ) -> tuple[int, list[int]]:
    """(static buffers, live intermediates at the step's peak) of a DecodeStepRunner of `rows` rows:
    static are StepInputs (int64 tokens, three int32 vectors; with the embedding on the host the
    rows' embeddings) and Workspace (float32 qkv, gate_up, the last hidden state);
    the intermediates (in the graph's pool) include the float32 logits it returns."""
    m, h, f, v = rows, config.hidden_size, config.intermediate_size, config.vocab_size
    hq, dim, d = config.num_heads, config.head_dim, s.dtype_bytes
    static = m * 8 + 3 * m * 4 + m * (config.q_size + 2 * config.kv_size) * 4 + m * 2 * f * 4 + m * h * 4
    if s.embedding_on_host:
        static += m * h * d  # the rows' embeddings, copied in before each replay
    if config.hybrid is not None and m > 1:
        static += 2 * m * 4  # int32 run lengths and rollback entries of a verify's rows (engine.runtime.hybrid_step)
    layer0 = {path.split(".")[-1]: fmt for path, fmt in formats.items() if path.startswith(_attention_layer(config))}
    wo = layer0["wo"]

    def act_quant(k: int, fmt: LinearFormat) -> list[int]:  # int8 activations, float32 scales, int32 sums
        return [m * k, m * (k // fmt.group_size) * 4, m * (k // fmt.group_size) * 4] if fmt.packed else [m * k * 4]

    q = m * hq * dim * d  # rope output in the cache dtype; held until the next layer's replaces it
    parts = [m * hq * s.num_splits * dim * 4, m * hq * s.num_splits * 4]  # split partials, log-sum-exp
    if wo.packed and wo.group_size == dim:
        attn = [m * hq * dim, m * hq * 4, m * hq * 4]  # attention → int8 per head for the packed o_proj
    else:
        attn = [m * hq * dim * d]
        parts = parts if s.num_splits > 1 else []
    widest = max((act_quant(k, layer0[n]) for n, k in (("wqkv", h), ("w13", h), ("w2", f), ("wo", config.q_size))),
                 key=sum)
    head = formats.get("lm_head", LinearFormat())
    head_tmp = act_quant(h, head) if head.packed else [m * h * 4, m * h * d, m * v * d]
    live = [m * h * 4, q, q, *attn, *attn, *parts, *max(widest, head_tmp, key=sum), m * v * 4]
    return static, live


def _decode_lines(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings) -> list[PlanLine]:
    lines = []
    for rows in range(1, s.graph_rows + 1):
        static, live = decode_step_bytes(config, formats, rows, s)
        pool = pool_segment_bytes(live) if s.cuda else sum(live)
        lines.append(PlanLine("decode", f"decode step, {rows} row{'s' if rows > 1 else ''}", static + pool,
                              "static inputs + workspace + graph pool" if s.cuda else "static + intermediates"))
    return lines


def prefill_bytes(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings) -> dict[str, int]:
    """Peak live activations of one prefill chunk (T = prefill_chunk_size rows) on a GPU, by phase."""
    t, sl, d = min(s.prefill_chunk_size, s.max_seq_len), s.max_seq_len, s.dtype_bytes
    h, f, hq, kvh = config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads
    dim = config.head_dim
    layer0 = {path.split(".")[-1]: fmt for path, fmt in formats.items() if path.startswith(_attention_layer(config))}
    shapes = {path.split(".")[-1]: (n, k) for path, n, k, _ in linear_modules(config)
              if path.startswith(_attention_layer(config))}

    def unpacked(name: str) -> int:  # packed layers of more rows than stay packed: a float Wᵀ slice for cuBLAS,
        n, k = shapes[name]          # its words and scales copied out, and the slice's product
        fmt = layer0[name]
        if not fmt.packed or t <= packed_rows_limit(s.cuda):
            return 0
        cols = unpack_columns(n, k, d, s.unpack_slice_bytes)
        if cols >= n:
            return n * k * d
        return k * cols * d + packed_bytes(fmt, cols, k) + t * cols * d

    base = 2 * t * h * d + 3 * t * dim // 2 * 4 + 2 * t * 8  # residual + its norm; rotary angles; positions
    masked = sl > t  # a later chunk of a longer context attends through a [T, S] mask
    if masked and s.cuda:  # engine.runtime.model.blocked_attention, at worst in the float32 math backend: the chunk's
        tb, g = attention_block_rows(hq, sl, t), hq // kvh  # mask, K/V as float32, per query block its mask
        attention = (t * sl * 5 + hq * t * dim * d + 2 * kvh * sl * dim * 4  # (bool + additive), q folded, scores
                     + g * tb * sl * 6 + hq * tb * dim * (2 * d + 8) + 2 * hq * tb * sl * 4)  # and softmax
    elif masked:  # the CPU: one call, float32 math: q, k/v, k/v repeated per query head, scores and softmax, mask
        attention = (t * sl * 5 + hq * t * dim * 4 + 2 * kvh * sl * dim * 4 + 2 * hq * sl * dim * 4
                     + 2 * hq * t * sl * 4 + hq * t * dim * 4)
    else:  # flash: output + log-sum-exp
        attention = hq * t * dim * d + hq * t * 4
    phases = {
        "qkv": t * (config.q_size + 2 * config.kv_size) * d + unpacked("wqkv"),
        "attention": t * hq * dim * d + attention,
        "o_proj": t * config.q_size * d + unpacked("wo") + t * h * d,
        "gate_up": t * 2 * f * d + unpacked("w13"), "swiglu": t * 2 * f * d + 2 * t * f * d,
        "down": t * f * d + unpacked("w2") + t * h * d}
    if config.hybrid is not None:  # a DeltaNet layer (engine.runtime.deltanet): projections, conv in and out, and
        hc = config.hybrid  # the rule: on a GPU the Triton kernels (q/k/v copied, their scratch, the float32 norm)
        hv, dk, dv = hc.linear_num_value_heads, hc.linear_key_head_dim, hc.linear_value_head_dim
        rule = (t * hc.conv_dim * d + prefill_scratch_bytes(1, t, hv, dk, dv) + 2 * t * hc.value_dim * 4 if s.cuda
                else hv * (3 * t * (2 * dk + 2 * dv) * 4 + 4 * round_up(t, 64) * 64 * 4))  # torch: [C, C] matrices
        phases["deltanet"] = t * (hc.conv_dim + hc.value_dim) * d * 2 + hc.conv_dim * (t + hc.conv_kernel) * d + rule
    return {"base": base, **phases}


def _attention_layer(config: ModelConfig) -> str:
    """The module prefix of the first attention layer (a hybrid's first layers are DeltaNet ones)."""
    first = next((i for i in range(config.num_layers) if not config.is_linear(i)), 0)
    return f"layers.{first}."


def _prefill_lines(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings) -> list[PlanLine]:
    phases = prefill_bytes(config, formats, s)
    base = phases.pop("base")
    worst = max(phases, key=phases.get)
    t = min(s.prefill_chunk_size, s.max_seq_len)
    line = PlanLine("prefill", f"prefill chunk of {t} tokens (peak: {worst})", base + phases[worst])
    if KV_TYPES[s.kv_type].quantized:  # the calibration pass of a quantized cache, before any prefill
        calibration = calibration_bytes(config, formats, s)
        if calibration > line.bytes:
            line = PlanLine("prefill", f"KV calibration pass ({CALIBRATION_TOKENS} tokens, float cache)", calibration,
                            f"more than a prefill chunk of {t} tokens ({base + phases[worst]:,} B)")
    return [line]


def calibration_bytes(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings) -> int:
    """engine.runtime.kv_calibration.key_offsets: a float KV cache of CALIBRATION_TOKENS positions (and a
    hybrid's one DeltaNet state) and one fresh (unmasked) pass over them."""
    n = CALIBRATION_TOKENS
    pass_settings = RunSettings(**{**vars(s), "max_seq_len": n, "prefill_chunk_size": n, "kv_type": "bf16",
                                   "kv_offload": False})
    phases = prefill_bytes(config, formats, pass_settings)
    base = phases.pop("base")
    state = config.hybrid.state_bytes_per_slot(s.dtype_bytes) if config.hybrid else 0
    cache = kv_bytes_per_token(KV_TYPES["bf16"], config.num_kv_layers, config.num_kv_heads, config.head_dim,
                               s.dtype_bytes) * n + state
    return cache + base + max(phases.values())


def load_transient_bytes(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings) -> int:
    """Peak temporaries of loading beyond the weights: one slice of the largest packed matrix (its
    generation for dummy weights; its rounding and packing for floats packed at load)."""
    shapes = {path: (n, k) for path, n, k, _ in linear_modules(config)}
    shapes["lm_head"] = (config.vocab_size, config.hidden_size)
    out = 0
    for path, fmt in formats.items():
        if not fmt.packed:
            continue
        n, k = shapes[path]
        source = s.dtype_bytes if path == "lm_head" else s.weight_dtype_bytes
        out = max(out, random_packed_transient(fmt.kind, n, k) if s.dummy else quantize_transient(fmt.kind, n, k, source))
    return out


def _load_lines(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings, later: int
                ) -> list[PlanLine]:
    """The part of the load's temporaries that the buffers allocated after loading (`later` bytes:
    KV cache, decode, prefill, logits, runtime) do not cover."""
    transient = load_transient_bytes(config, formats, s)
    if transient <= later:
        return []
    return [PlanLine("load", "loading: one matrix slice's temporaries", transient - later,
                     f"{transient:,} B while loading, beyond the buffers allocated after it")]


def _logits_lines(config: ModelConfig, s: RunSettings) -> list[PlanLine]:
    rows = max(s.slots, s.graph_rows)
    per_logit = 4 + SAMPLING_BYTES_PER_LOGIT + PENALTY_BYTES_PER_LOGIT  # the float32 copy the runner returns
    return [PlanLine("logits", f"logits, sampling and penalty counts, {rows} row{'s' if rows > 1 else ''}",
                     rows * config.vocab_size * per_logit)]


def make_plan(config: ModelConfig, formats: dict[str, LinearFormat], s: RunSettings,
              drafter: MemoryPlan | None = None) -> MemoryPlan:
    """Every byte the run puts on its device (see the module doc), plus what it keeps in host RAM."""
    if s.embedding_on_host:
        check_embedding_on_host(config.tie_word_embeddings, formats.get("lm_head", LinearFormat()).kind
                                if "lm_head" in formats else "bf16")
    weights, host_weights = _weight_lines(config, formats, s)
    kv, host_kv = _kv_lines(config, s)
    rest = kv + _decode_lines(config, formats, s) + _prefill_lines(config, formats, s) + _logits_lines(config, s)
    if s.cuda:
        rest.append(PlanLine("runtime", "cuBLAS / cuBLASLt workspaces", CUBLAS_WORKSPACES, "estimate"))
    lines = weights + _load_lines(config, formats, s, sum(line.bytes for line in rest)) + rest
    host = host_weights + host_kv
    if drafter is not None:
        lines += [PlanLine("drafter", f"{line.category}: {line.name}", line.bytes, line.note)
                  for line in drafter.lines if line.category != "runtime"]
        host += drafter.host_lines
    return MemoryPlan(lines, host)
