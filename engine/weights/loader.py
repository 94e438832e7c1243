"""`load_model`: a path (GGUF file or HF directory) → a ready model, tokenizer and description."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from engine.errors import BonsaiError, ModelFileError
from engine.memory.host_embedding import HostEmbedding, check_embedding_on_host
from engine.pipeline.naming import global_name, layer_index, local_name, stage_holds
from engine.runtime.input_rotation import set_input_rotations
from engine.runtime.linear import cpu_bf16_gemm
from engine.runtime.narrow_head import narrow_output_layer
from engine.runtime.model import Linear, Transformer, rotary_inverse_frequencies
from engine.sources.checkpoint_file import BonsaiCheckpoint
from engine.sources.gguf_file import GGUFFile
from engine.sources.hf_files import HFModelDir
from engine.sources.model_check import expected_shapes
from engine.sources.model_config import ModelConfig
from engine.sources.prism_rotation import InputRotationSpec
from engine.sources.tokenizer import Tokenizer
from engine.weights.cpu_int4_load import cpu_int4_layers, native_head, pack_cpu_int4, resolve_cpu_kernels
from engine.weights.formats import WeightFormat, linear_formats, linear_modules, stored_formats
from engine.weights.packed_linear import PackedLinear, empty_packed, pack_linears, quantize_rows, tensor_generator
from engine.weights.packed_load import pack_stored_codes
from quant.checkpoint import is_checkpoint
from quant.packed_layout import PackedWeight


@dataclass
class TensorSummary:
    """What `bonsai info` shows: tensor types with their counts, parameters and bytes."""
    format: str  # "gguf" | "hf" | "bonsai" | "dummy"
    num_tensors: int
    num_parameters: int
    file_bytes: int
    types: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # type → (tensors, params, bytes)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.file_bytes / max(self.num_parameters, 1)


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer | None  # None for generated (dummy) weights
    config: ModelConfig
    path: Path
    summary: TensorSummary
    device: torch.device
    dtype: torch.dtype
    weight_dtype: torch.dtype
    load_seconds: float = 0.0
    weight_format: WeightFormat = field(default_factory=WeightFormat)
    cpu_int4: bool = False  # loaded with cpu_int4 (a draft model follows it)
    int4_layers: int = 0  # block matrices run as stored (engine.weights.cpu_int4_load)
    cpu_kernels: str = ""  # the CPU kernel set for them: "native" or "torch" ("" when not asked for)

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise BonsaiError(f"{self.path} has generated (dummy) weights and no tokenizer: it can only be "
                              "benchmarked with random tokens (bonsai bench -p/-n), not given text; set "
                              "model.tokenizer to a model whose tokenizer it should borrow")
        return self.tokenizer


def open_model_source(path: Path) -> GGUFFile | HFModelDir | BonsaiCheckpoint:
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"model file not found: {path}")
    if path.is_dir() and is_checkpoint(path):  # its safetensors metadata says format bonsai
        return BonsaiCheckpoint(path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return GGUFFile(ggufs[0])
        return HFModelDir(path)
    return GGUFFile(path)


def summarize(source: GGUFFile | HFModelDir | BonsaiCheckpoint) -> TensorSummary:
    info = source.tensor_info()
    types: Counter = Counter()
    params: Counter = Counter()
    nbytes: Counter = Counter()
    for _, type_name, shape, size in info:
        n = 1
        for s in shape:
            n *= s
        types[type_name] += 1
        params[type_name] += n
        nbytes[type_name] += size
    return TensorSummary(
        format="gguf" if isinstance(source, GGUFFile) else getattr(source, "format_name", "hf"),
        num_tensors=len(info), num_parameters=sum(params.values()), file_bytes=sum(nbytes.values()),
        types={t: (types[t], params[t], nbytes[t]) for t in sorted(types, key=lambda t: -nbytes[t])})


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BonsaiError(f"unsupported device '{device}': use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BonsaiError(f"device '{device}' was asked for but no CUDA GPU is available "
                          "(use device: cpu, or install the CUDA build of torch)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise BonsaiError(f"device '{device}' does not exist: this machine has "
                          f"{torch.cuda.device_count()} CUDA GPU(s)")
    if dev.type not in ("cpu", "cuda"):
        raise BonsaiError(f"unsupported device '{device}': use cpu or cuda[:N]")
    return dev


def expected_tensor_names(cfg: ModelConfig) -> set[str]:
    return set(expected_shapes(cfg))


def default_weight_dtype(device: torch.device, dtype: torch.dtype, int4: bool = False) -> torch.dtype:
    """float16 block matrices under float32 activations on the CPU (its fp16 gemv reads 2x fewer bytes and runs
    ~3x faster than the float32 one; rounding ~5e-4 relative), else the compute dtype. The embedding and the output
    layer keep the compute dtype: logits stay float32-exact in their last step. int4 (4-bit matrices on the CPU's
    int4 kernel): the others bfloat16 where the CPU multiplies it natively, one GEMM at any row count (a 4-row
    verify ~1.3 decode steps, float16's ~2; KL 1.1e-4 vs 7e-5: docs/perf.md session 23)."""
    if device.type == "cpu" and dtype == torch.float32:
        return torch.bfloat16 if int4 and cpu_bf16_gemm() else torch.float16
    return dtype


HOST = torch.device("cpu")


def placed(name: str, dev: torch.device, host_layers: frozenset[int]) -> torch.device:
    """Where the module or tensor `name` (global) is made: host memory for the blocks in host_layers
    (streamed by engine.memory.weight_offload: never allocated on `dev`), else `dev`."""
    return HOST if host_layers and layer_index(name) in host_layers else dev


def _empty_model(config: ModelConfig, dev: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype,
                 meta_weights: frozenset[str] = frozenset(), embedding_on_host: bool = False,
                 stage=None, host_layers: frozenset[int] = frozenset()) -> Transformer:
    """The model with uninitialized tensors on `dev`; the weights of the Linear layers named in
    meta_weights (global names) stay on the meta device (they are replaced before use: never allocated);
    embedding_on_host: the embedding table is allocated in host memory (never on `dev`);
    stage: a pipeline stage (engine.pipeline.split.Stage): only its part is allocated;
    host_layers: these blocks are allocated in host memory (`placed`)."""
    with torch.device("meta"):
        model = Transformer(config)
        model.to(dtype)
        for module in model.modules():
            if isinstance(module, Linear) and module is not model.lm_head:
                module.weight.data = module.weight.data.to(weight_dtype)
        if stage is not None:
            model.keep_layers(stage.first, stage.end, stage.takes_tokens, stage.gives_logits)
    for local, module in model.named_modules():
        name = global_name(local, model.first_layer)
        if not stage_holds(stage, config, name):
            continue
        where = placed(name, dev, host_layers)
        if name == "embed" and embedding_on_host:
            module.to_empty(device="cpu", recurse=False)
        elif name not in meta_weights:
            module.to_empty(device=where, recurse=False)
        elif module.bias is not None:
            module.bias = torch.nn.Parameter(torch.empty_like(module.bias, device=where), requires_grad=False)
    model.inv_freq = rotary_inverse_frequencies(config).to(dev)
    return model


def _part_rows(config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """canonical tensor name → (Linear module path, its first row in the module's fused matrix, its rows)."""
    sizes = {"q_proj": config.q_rows, "k_proj": config.kv_size, "v_proj": config.kv_size,
             "gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    out = {}
    for path, n, _, parts in linear_modules(config):
        row = 0
        for name in parts:
            rows = sizes.get(name.split(".")[-2], n)
            out[name] = (path, row, rows)
            row += rows
    return out


def _packed_shells(model: Transformer, targets: dict[str, str], group_size: int, dev: torch.device,
                   host_layers: frozenset[int] = frozenset()) -> dict[str, PackedWeight]:
    """Swap the Linear layers in targets (global module path → packed kind) for PackedLinear layers with
    empty packed buffers on `dev` (host memory for the blocks in host_layers), filled as their float
    tensors arrive (`quantize_rows`)."""
    out = {}
    for path, kind in targets.items():  # global names; a pipeline stage's layer i is first_layer + i
        local = local_name(path, model.first_layer)
        module = model.get_submodule(local)
        pw = empty_packed(kind, module.weight.shape[0], module.weight.shape[1], group_size,
                          placed(path, dev, host_layers))
        parent, _, attr = local.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, PackedLinear(pw, module.bias))
        out[path] = pw
    return out


def model_from_tensors(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], dev: torch.device,
                       dtype: torch.dtype, weight_dtype: torch.dtype, path: str | Path, down_hadamard: int = 0,
                       meta_weights: dict[str, list[str]] | None = None, weight_format: WeightFormat | None = None,
                       embedding_on_host: bool = False, stage=None, host_layers: frozenset[int] = frozenset(),
                       input_rotations: dict[str, InputRotationSpec] | None = None) -> Transformer:
    """A model of `config` from (canonical name, float tensor) pairs (every tensor it needs, once);
    down_hadamard > 0: the online Hadamard of a rotated checkpoint on the down projections' inputs;
    input_rotations: {linear layer (global path): its input's rotation} of a file with folded rotations
    (engine.runtime.input_rotation; a Prism GGUF's, engine.sources.prism_rotation).
    meta_weights: {Linear module name: the canonical tensors it stacks} of layers left unallocated
    (packed later from stored codes): `tensors` does not hold those. weight_format: the layers it
    packs are packed as their tensors arrive (each tensor rounded, a slice of rows at a time, into
    the final packed buffers: no float copy of the layer is ever allocated on `dev`); a tied output
    layer is left to `pack_linears`. embedding_on_host: the table is loaded into host memory.
    stage: build only this pipeline stage's part (tensors of other stages are passed over).
    host_layers: these blocks are made in host memory, never on `dev` (`placed`)."""
    meta_weights = meta_weights or {}
    fmt = weight_format or WeightFormat()
    targets = {name: f.kind for name, f in linear_formats(config, fmt).items()
               if f.packed and name not in meta_weights and (name != "lm_head" or not config.tie_word_embeddings)
               and stage_holds(stage, config, name)}  # global module names
    model = _empty_model(config, dev, dtype, weight_dtype, meta_weights=frozenset(meta_weights) | frozenset(targets),
                         embedding_on_host=embedding_on_host, stage=stage, host_layers=host_layers)
    shells = _packed_shells(model, targets, fmt.group_size, dev, host_layers)
    rows_of = _part_rows(config) if shells else {}
    expected = expected_tensor_names(config) - {n for names in meta_weights.values() for n in names}
    expected = {n for n in expected if stage_holds(stage, config, n)}
    seen: set[str] = set()
    for name, tensor in tensors:
        if not stage_holds(stage, config, name):
            continue
        module_path, row0, rows = rows_of.get(name, (None, 0, 0))
        try:
            if module_path in shells:
                pw = shells[module_path]
                if tuple(tensor.shape) != (rows, pw.in_features):
                    raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                                     f"{(rows, pw.in_features)}")
                # rounded from the weight dtype's values, as a float layer packed after loading would be
                quantize_rows(pw, row0, tensor.to(dtype if module_path == "lm_head" else weight_dtype))
            else:
                model.load_tensor(name, tensor)
        except (KeyError, ValueError, AssertionError) as e:
            raise ModelFileError(f"{path}: tensor {name} does not fit the architecture ({e})") from None
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(f"{path} lacks tensors the architecture needs: {', '.join(missing[:3])}{more}")
    specs = dict(input_rotations or {})
    if down_hadamard:
        if config.intermediate_size % down_hadamard:
            raise ModelFileError(f"{path}: its online Hadamard block {down_hadamard} does not divide the FFN width "
                                 f"{config.intermediate_size}; quantize it again")
        specs.update({f"layers.{i}.feed_forward.w2": InputRotationSpec(config.intermediate_size, down_hadamard)
                      for i in range(config.num_layers)})
    set_input_rotations(model, specs, lambda name: placed(name, dev, host_layers))
    return model


def _finish_embedding(model: Transformer, dev: torch.device, on_host: bool) -> None:
    """Move the loaded host table behind a HostEmbedding (after packing: a tied output layer has
    taken its own packed copy by then)."""
    if on_host and model.takes_tokens:
        assert model.lm_head is not None, "check_embedding_on_host refuses a tied float output layer"
        model.embed = HostEmbedding(model.embed.weight.data, dev)


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               weight_dtype: torch.dtype | None = None, weight_format: WeightFormat | None = None,
               keep_codes: bool | None = None, embedding_on_host: bool = False, stage=None,
               host_layers: frozenset[int] = frozenset(), cpu_int4: bool = False,
               narrow_head: str | None = None, cpu_kernels: str = "auto") -> LoadedModel:
    """Load a GGUF file or a HF directory; weights are materialized one tensor at a time.

    dtype: activations and norms (float32 on CPU, bfloat16 on CUDA); weight_dtype: the matrices
    (default_weight_dtype); weight_format: pack the matrices at load (round-to-nearest) for the packed kernels;
    keep_codes: tensors stored quantized (checkpoints, TQ1_0/TQ2_0/Q1_0/Q2_0) run packed (default on CUDA);
    embedding_on_host: the embedding table stays in host memory; stage: a pipeline stage (its layers, embedding and
    output layer only are read); host_layers: these blocks are packed in host memory (a WeightStreamer streams
    them). cpu_int4: on the CPU, a GGUF's block matrices run as stored by the `cpu_kernels` set (auto, native or
    torch: engine.weights.cpu_int4_load); narrow_head: on the CPU, a float32 output layer runs as one "float16" or
    "int8" GEMM with its top logits exact (engine.runtime.narrow_head)."""
    start = time.perf_counter()
    dev = resolve_device(device)
    source = open_model_source(Path(path))
    config = source.model_config()
    weight_format = weight_format or WeightFormat()
    if embedding_on_host:
        check_embedding_on_host(config.tie_word_embeddings, weight_format.head_type)
    tokenizer = source.tokenizer()
    dtype = dtype or default_dtype(dev)
    rotation = getattr(source, "rotation", None) or {}
    keep = keep_codes if keep_codes is not None else dev.type == "cuda"
    # layers packed from stored codes are never materialized as floats (a 27B float copy would not fit its GPU)
    stored = {name: parts for name, parts in (stored_packed_layers(source, config) if keep else {}).items()
              if stage_holds(stage, config, name)}
    as_stored = cpu_int4 and dev.type == "cpu" and not weight_format.packed and not keep
    kernels = resolve_cpu_kernels(cpu_kernels) if as_stored else ""
    int4 = cpu_int4_layers(source, config, stage, kernels) if kernels else {}
    weight_dtype = weight_dtype or default_weight_dtype(dev, dtype, int4=bool(int4))
    skip = frozenset(n for names in [*stored.values(), *int4.values()] for n in names)
    if stage is not None and not isinstance(source, HFModelDir):  # other stages' tensors are not even read
        skip |= frozenset(n for n in expected_tensor_names(config) if not stage_holds(stage, config, n))
    tensors = source.iter_canonical_tensors(config, skip=skip) if skip else source.iter_canonical_tensors(config)
    model = model_from_tensors(config, tensors, dev, dtype, weight_dtype, path,
                               down_hadamard=int(rotation.get("down_proj_hadamard", 0)),
                               meta_weights={**stored, **int4},
                               weight_format=weight_format, embedding_on_host=embedding_on_host, stage=stage,
                               host_layers=host_layers, input_rotations=getattr(source, "input_rotations", None))
    if keep:
        packed = pack_stored_codes(model, source, config, device=dev, host_layers=host_layers,
                                   ternary=weight_format.ternary_kind)
        packed = {global_name(name, model.first_layer) for name in packed}
        assert set(stored) <= packed, f"planned packed layers were not packed: {sorted(set(stored) - packed)[:3]}"
    pack_cpu_int4(model, source, config, int4, kernels)
    if weight_format.packed:
        pack_linears(model, weight_format, device=dev, host_layers=host_layers)  # what is left: a tied output layer's own packed copy
    _drop_unused_embedding(model)
    _finish_embedding(model, dev, embedding_on_host)
    if narrow_head and dev.type == "cpu" and model.gives_logits and not (kernels == "native"
                                                                         and native_head(model, source, config)):
        narrow_output_layer(model, narrow_head)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=Path(path),
                       summary=summarize(source), device=dev, dtype=dtype, weight_dtype=weight_dtype,
                       load_seconds=time.perf_counter() - start, weight_format=weight_format,
                       cpu_int4=cpu_int4 and dev.type == "cpu", int4_layers=len(int4), cpu_kernels=kernels)


def stored_packed_layers(source, config: ModelConfig) -> dict[str, list[str]]:
    """{Linear module name: its canonical tensors} of the layers `pack_stored_codes` will pack from
    the source's stored codes, known from metadata alone (GGUF Q2_0 layers, whose layout depends on
    their codes, are left out: they load as floats first)."""
    found = stored_formats(source, exact=True)
    if not found:
        return {}
    formats = linear_formats(config, stored=found)
    return {path: parts for path, _, _, parts in linear_modules(config) if formats[path].packed}


@torch.no_grad()
def load_dummy(config: ModelConfig, name: str, device: str | torch.device = "cpu",
               weight_format: WeightFormat | None = None, dtype: torch.dtype | None = None,
               seed: int = 0, embedding_on_host: bool = False, stage=None,
               host_layers: frozenset[int] = frozenset()) -> LoadedModel:
    """`load_format: dummy`: the architecture at full size with random weights made directly on the
    device in their run-time format (packed codes for tri/bin/int4/int8), one matrix at a time in
    its final buffer — for speed work. embedding_on_host: the table is made in host memory. Each
    tensor's values depend on the seed and its name only, so a pipeline stage (`stage`: only its
    part is made) holds the same weights as the whole model. host_layers: these blocks are made in host
    memory, never on the device (the blocks a WeightStreamer streams)."""
    start = time.perf_counter()
    dev = resolve_device(device)
    dtype = dtype or default_dtype(dev)
    weight_format = weight_format or WeightFormat()
    if embedding_on_host:
        check_embedding_on_host(config.tie_word_embeddings, weight_format.head_type)
    # layers generated packed are never allocated as floats (a 27B model's float copy would not fit
    # the GPU memory its packed form is meant for)
    packed = frozenset(name for name, f in linear_formats(config, weight_format).items()
                       if f.packed and (name != "lm_head" or not config.tie_word_embeddings))
    model = _empty_model(config, dev, dtype, dtype, meta_weights=packed, embedding_on_host=embedding_on_host,
                         stage=stage, host_layers=host_layers)
    for param_name, p in model.named_parameters():
        if p.is_meta:
            continue
        if p.dim() == 1:
            p.fill_(1.0)  # norms (and biases: harmless)
        else:  # every float matrix that exists (packed ones are on the meta device): the float layers, the
            # embedding, a float head, a hybrid's in_proj_a/b and conv weights (float in every format)
            p.normal_(0.0, 0.02, generator=tensor_generator(p.device, seed, global_name(param_name, model.first_layer)))
    pack_linears(model, weight_format, dummy=True, seed=seed, device=dev, host_layers=host_layers)
    _drop_unused_embedding(model)
    _finish_embedding(model, dev, embedding_on_host)
    model.eval()
    nbytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    nbytes += model.embed.nbytes if isinstance(model.embed, HostEmbedding) else 0
    summary = TensorSummary(format="dummy", num_tensors=len(list(model.parameters())) + len(list(model.buffers())),
                            num_parameters=config.num_parameters(), file_bytes=nbytes)
    return LoadedModel(model=model, tokenizer=None, config=config, path=Path(name), summary=summary, device=dev,
                       dtype=dtype, weight_dtype=dtype, load_seconds=time.perf_counter() - start,
                       weight_format=weight_format)


def _drop_unused_embedding(model: Transformer) -> None:
    """A last pipeline stage held the (tied) embedding to make its output layer; once that layer
    is packed on its own the embedding is unused there: back to the meta device."""
    if not model.takes_tokens and model.lm_head is not None and not model.embed.weight.is_meta:
        model.embed.weight = torch.nn.Parameter(torch.empty_like(model.embed.weight, device="meta"),
                                                requires_grad=False)
