"""Compile every Triton kernel signature the engine launches, for a CUDA architecture, on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts code the compiler refuses (a
constexpr rebound in a static loop; a variable that a runtime branch redefines with another dtype:
both reached the H200 as CompilationErrors). A hand-written list of kernel calls drifts from what the
engine launches (it compiled the rope kernel with float32 inputs while models launch it with bf16), so
this check drives the engine itself: for every combination a config can select (architecture, KV type,
weight and head types, activation dtype, group size, rotation, embedding on host, offloads:
`engine_cases`) a tiny generated model runs prefill chunks, a decode step, batched rows and verify widths
through `ModelRunner`, with the kernels on (BONSAI_KERNELS_ON_CPU=1) and a stand-in CUDA driver that
reports the chosen architecture and turns every launch into a compile-only warm-up. Nothing runs:
outputs are garbage, only what is launched matters. Every distinct (kernel, constexprs, dtypes, integer
specializations, launch options) signature goes through Triton's front end, and a covering subset on
through its whole pipeline to ptxas and a cubin (`CompilePolicy`: a full compile of every signature, for
two architectures and two Triton versions, would take CI ~20 minutes). The check fails when a compile
fails, and when a kernel launch site in engine/ or quant/ is reached by no case (`launch_sites`).

    python -m tests.kernel_compile --arch 90      # one line per case, a summary, exit 1 on any failure
"""
from __future__ import annotations

import argparse
import ast
import inspect
import os
import sys
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tests.kernel_compile_library import library_cases

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Launch:
    name: str
    signature: tuple
    site: tuple[str, int]  # (path relative to the repo, line) of the launching call
    cubin_bytes: int  # -1: not compiled to a cubin (CompilePolicy)
    depth: str  # cubin | ttir | same front end (first launch of the signature) | cached (seen before)
    shared_bytes: int = -1  # shared memory a program needs (a cubin's metadata; -1: not compiled that far)


def _signature(fn, args: tuple, kwargs: dict) -> tuple:
    """What Triton specializes a compiled kernel on: constexpr values, pointer dtypes, integer
    specializations (== 1, divisible by 16), and the launch options."""
    values = dict(zip([p.name for p in fn.params], args)) | {k: v for k, v in kwargs.items()
                                                              if k in {p.name for p in fn.params}}
    parts = []
    for p in fn.params:
        v = values.get(p.name)
        if isinstance(v, torch.Tensor):
            parts.append((p.name, str(v.dtype)))
        elif p.is_constexpr or v is None or isinstance(v, bool):
            parts.append((p.name, v))
        elif isinstance(v, int):
            parts.append((p.name, "int", v == 1, v % 16 == 0))
        else:
            parts.append((p.name, type(v).__name__))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in values))
    return (fn.__name__, tuple(parts), options)


def _launch_site() -> tuple[str, int]:
    """The first frame outside Triton and this file: the engine's `kernel[grid](...)` call."""
    here = Path(__file__).resolve()
    frame = inspect.currentframe()
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path != here and "triton" not in path.parts and ROOT in path.parents:
            return str(path.relative_to(ROOT)), frame.f_lineno
        frame = frame.f_back
    return "?", 0


class CompilePolicy:
    """Which launches go through Triton's whole pipeline (to a cubin) and which through its front end only.

    Every distinct signature goes through the front end (the Python AST to Triton IR: where a variable whose
    dtype differs between branches, a constexpr rebound or a bad `tl.*` call fails) and its first IR passes;
    a signature that brings a (kernel, parameter, value) pair not yet compiled to a cubin goes on through
    layouts, LLVM and ptxas (an online cover: every constexpr value, dtype, integer specialization and launch
    option of every kernel meets the back end at least once). Signatures that differ only in integer
    specializations share one front-end run."""

    def __init__(self) -> None:
        self.covered: set = set()
        self.front_ended: set = set()

    def depth(self, signature: tuple) -> str:
        name, parts, options = signature
        pairs = {(name, p) for p in parts} | {(name, o) for o in options}
        if pairs - self.covered:
            self.covered |= pairs
            return "cubin"
        core = (name, tuple(p for p in parts if not (len(p) == 4 and p[1] == "int")), options)
        if core in self.front_ended:
            return "same front end"
        self.front_ended.add(core)
        return "ttir"


class FrontEndOnly:
    """What a launch compiled through the front end only returns (nothing can run it)."""
    asm: dict = {}

    def __init__(self, depth: str):
        self.depth = depth


def _front_end(src, target=None, options=None, _env_vars=None) -> FrontEndOnly:
    """Triton's compile() up to its first IR stage (ttir): the AST is code-generated and verified."""
    from triton._C.libtriton import ir
    from triton.compiler.compiler import make_backend
    backend = make_backend(target)
    opts = backend.parse_options(dict(options or {}, **src.parse_options()))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    stages: dict = {}
    backend.add_stages(stages, opts, src.language)
    stages["ttir"](module, {})
    return FrontEndOnly("ttir")


def install_compile_only_driver(arch: int) -> list[Launch]:
    """A stand-in driver for `arch` (e.g. 90) and compile-only launches (CompilePolicy decides how deep);
    returns the list that every launch is appended to (a signature seen before is not compiled again:
    Triton's own cache)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    class CompileOnlyCuda:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(CompileOnlyCuda())
    launches: list[Launch] = []
    launch, do_compile = JITFunction.run, JITFunction._do_compile
    policy = CompilePolicy()
    seen: dict[tuple, str] = {}
    depth_now = ["cubin"]

    def compile_to_depth(self, *args, **kwargs):  # Triton's own compile call, redirected for a shallower depth
        if depth_now[0] == "cubin":
            return do_compile(self, *args, **kwargs)
        full_compile = self.compile
        self.compile = _front_end if depth_now[0] == "ttir" else (lambda *a, **k: FrontEndOnly(depth_now[0]))
        try:
            return do_compile(self, *args, **kwargs)
        finally:
            self.compile = full_compile

    def compile_only(self, *args, grid, warmup, **kwargs):
        signature = _signature(self, args, kwargs)
        first = signature not in seen
        depth_now[0] = seen[signature] = seen.get(signature) or policy.depth(signature)
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        cubin = len(kernel.asm.get("cubin", b"")) if depth_now[0] == "cubin" else -1
        shared = int(getattr(getattr(kernel, "metadata", None), "shared", -1)) if cubin > 0 else -1
        launches.append(Launch(self.fn.__name__, signature, _launch_site(), cubin,
                               depth_now[0] if first else "cached", shared))
        return kernel

    JITFunction._do_compile = compile_to_depth
    JITFunction.run = compile_only
    return launches


def launch_sites() -> set[tuple[str, int, int]]:
    """Every `name[grid](...)` call (a Triton launch) in the modules of engine/ and quant/ that import
    triton: (path, first line, last line)."""
    sites = set()
    for package in ("engine", "quant"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if "import triton" not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                        and isinstance(node.func.value, (ast.Name, ast.Attribute)):
                    sites.add((str(path.relative_to(ROOT)), node.lineno, node.end_lineno))
    return sites


@dataclass(frozen=True)
class Case:
    """One combination a config can select, on a tiny generated model."""
    architecture: str = "qwen3"  # llama | qwen2 (q/k/v biases) | qwen3 (q/k norms) | qwen35 (hybrid)
    kv_type: str = "bf16"  # bf16 | int8 | int4 | k8v4
    weights: str = "tri"  # bf16 | tri | bin | int4 | int8 (tri-dense files run the tri layout)
    head: str = "bf16"
    dtype: torch.dtype = torch.bfloat16
    group_size: int = 128
    head_dim: int = 64
    max_seq_len: int = 64  # 2048: the decode attention splits (and their combine kernel)
    down_hadamard: bool = False  # a rotated checkpoint: the online Hadamard before down_proj
    embedding_on_host: bool = False
    offload: str = ""  # "" | "kv" | "weights"
    ternary_layout: str = "2bit"  # base3: ternary matrices (and a ternary head) in the tri5 layout

    @property
    def label(self) -> str:
        extras = [f"g{self.group_size}", f"d{self.head_dim}", f"S{self.max_seq_len}"]
        extras += [name for name, on in (("rotated", self.down_hadamard), ("host-embedding", self.embedding_on_host),
                                         (f"{self.offload}-offload", bool(self.offload)),
                                         ("base3", self.ternary_layout == "base3")) if on]
        return (f"{self.architecture} {self.weights}/{self.head} kv={self.kv_type} {str(self.dtype)[6:]} "
                + " ".join(extras))


def engine_cases() -> list[Case]:
    """A covering set: every architecture x KV type x activation dtype (the rope/KV-write, attention and
    prefill kernels' variants), each weight type with each dtype and group size in turn (the GEMV,
    activation-quantization and dequantization variants), every head type, long caches (split decode
    attention), and the host paths (rotation, host embedding, KV and weight offload)."""
    weights = ("tri", "bin", "int4", "int8", "bf16")
    heads = ("bf16", "int4", "int8", "tri", "bin")
    groups = (128, 64, 32, 256)
    cases, i = [], 0
    for architecture in ("llama", "qwen2", "qwen3"):
        for kv_type in ("bf16", "int8", "int4", "k8v4"):
            for dtype in (torch.bfloat16, torch.float16):
                cases.append(Case(architecture, kv_type, weights[i % 5], heads[(i // 5) % 5], dtype,
                                  groups[i % 4], head_dim=128 if architecture == "qwen3" else 64,
                                  max_seq_len=2048 if i % 3 == 0 else 64))
                i += 1
    for weight in weights[:4]:  # each packed kind at every group size, in both dtypes
        for j, group in enumerate(groups):
            cases.append(Case(weights=weight, group_size=group, dtype=(torch.bfloat16, torch.float16)[j % 2],
                              head=weight))
    base = Case(kv_type="int8", weights="tri", head="int4")
    cases += [replace(base, down_hadamard=True), replace(base, down_hadamard=True, weights="bin", group_size=64),
              replace(base, embedding_on_host=True), replace(base, offload="kv"),
              replace(base, offload="weights", kv_type="k8v4"), replace(base, architecture="llama", offload="weights")]
    # the base-3 ternary layout (tri5: its GEMV at 1-16 rows, its dequantization for prefill) at each group
    # it takes, in both dtypes, with a tri5 head, and streamed from host memory
    cases += [Case(weights="tri", head="tri", group_size=group, dtype=dtype, ternary_layout="base3")
              for group, dtype in ((128, torch.bfloat16), (64, torch.float16), (256, torch.bfloat16))]
    cases.append(replace(base, offload="weights", ternary_layout="base3"))
    # a hybrid (Qwen3.5: DeltaNet + gated attention): the DeltaNet decode kernels, both dtypes (head_dim 128:
    # DeltaNet heads of 128 as the real models have, the recurrent kernel's 8-warp variant); the gated attention's
    # prologue on each quantized KV type, and at the real models' head_dim 256 with split attention
    cases += [Case("qwen35", "bf16", "tri", "int4"), Case("qwen35", "bf16", "bin", "bf16", torch.float16, 64, 128),
              Case("qwen35", "int8", "tri", "int4"), Case("qwen35", "k8v4", "int4", "bf16", torch.float16, 64, 128),
              Case("qwen35", "int4", "tri", "int4", head_dim=256, max_seq_len=2048)]
    return cases


def _config(case: Case):
    from engine.sources.hybrid_config import HybridConfig
    from engine.sources.model_config import ModelConfig
    heads, kv_heads = 4, 2
    hybrid = None
    if case.architecture == "qwen35":  # one DeltaNet layer (heads of head_dim / 2, or 128), then one gated attention
        d = 128 if case.head_dim >= 128 else case.head_dim // 2
        hybrid = HybridConfig(("linear_attention", "full_attention"), linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=d, linear_value_head_dim=d)
    return ModelConfig(architecture=case.architecture, vocab_size=512, hidden_size=256, intermediate_size=512,
                       num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=case.head_dim,
                       attention_bias=case.architecture == "qwen2", qk_norm=case.architecture in ("qwen3", "qwen35"),
                       tie_word_embeddings=case.architecture == "llama" and case.head != "bf16",
                       max_position_embeddings=4096, hybrid=hybrid)


def run_case(case: Case) -> None:
    """Build the tiny model and drive every kind of step the engine has through ModelRunner."""
    from engine.weights.loader import load_dummy
    from engine.weights.formats import WeightFormat
    from engine.runtime.runner import ModelRunner
    cfg = _config(case)
    fmt = WeightFormat(quant_type=case.weights, group_size=case.group_size, head_type=case.head,
                       ternary_layout=case.ternary_layout)
    loaded = load_dummy(cfg, "compile-check", "cpu", fmt, dtype=case.dtype, embedding_on_host=case.embedding_on_host)
    if case.down_hadamard:
        for block in loaded.model.layers:
            block.feed_forward.set_down_hadamard(cfg.intermediate_size, "cpu")
    runner = ModelRunner(loaded, max_seq_len=case.max_seq_len, num_slots=2, prefill_chunk_size=16, fast_decode=True,
                         kv_type=case.kv_type, kv_offload=case.offload == "kv",
                         offload_layers=[1] if case.offload == "weights" else None)
    assert runner.decoder is not None and runner.decoder.ops.fast, "the fused decode step did not take the kernels"
    first, second = runner.slot(0), runner.slot(1)
    runner.prefill(first, [i % cfg.vocab_size for i in range(19)])  # a 16-row chunk, then 3 rows (the GEMV path)
    runner.forward(first, [5])  # the fused decode step, one row
    runner.prefill(second, [1, 2, 3])
    runner.decode_batch([first, second], [6, 7])  # two slots in one step
    for width in (3, 6, 12):  # verify widths: the 4-, 8- and 16-row variants of the fused step
        runner.verify(first, [8] * width)
        first.rewind(width)
    runner.verify(first, [9] * 3, hidden_layers=(0,))  # the hidden-state drafters' verify: the model's path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200, 89: RTX 40, 86: RTX 30)")
    parser.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("run without TRITON_INTERPRET=1: the interpreter replaces the kernels it should compile", file=sys.stderr)
        return 2
    os.environ["BONSAI_KERNELS_ON_CPU"] = "1"  # the engine takes its kernel paths on CPU tensors
    import triton
    import quant.kernels
    from engine.kernels import SHARED_MEMORY_BYTES
    quant.kernels.pdl_enabled = lambda device: args.arch >= 90  # compile the PDL variants where they exist
    launches = install_compile_only_driver(args.arch)
    failures = 0
    runs = [(case.label, lambda case=case: run_case(case)) for case in engine_cases()] + list(library_cases())
    for label, call in runs:
        before = len(launches)
        try:
            call()
        except Exception as error:  # noqa: BLE001 - every failure is reported, then the exit code says it
            failures += 1
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            print(f"FAILED {label}: {type(error).__name__}: {first}")
            detail = [line for line in str(error).splitlines() if "Error(" in line or "error:" in line.lower()]
            if detail:
                print(f"    {detail[-1].strip()}")
            if os.environ.get("BONSAI_DEBUG"):
                traceback.print_exc()
            continue
        empty = sorted({x.name for x in launches[before:] if x.cubin_bytes == 0})
        limit = SHARED_MEMORY_BYTES.get(args.arch, min(SHARED_MEMORY_BYTES.values()))  # (the H200 found one)
        too_big = sorted({f"{x.name} ({x.shared_bytes} bytes)" for x in launches[before:] if x.shared_bytes > limit})
        if empty:
            failures += 1
            print(f"FAILED {label}: no cubin for {', '.join(empty)}")
        elif too_big:
            failures += 1
            print(f"FAILED {label}: shared memory above sm_{args.arch}'s {limit} bytes: {', '.join(too_big)}")
        elif not args.quiet:
            print(f"ok {label}: {len(launches) - before} launches")
    reached = {x.site for x in launches}
    missed = sorted(f"{path}:{first}" for path, first, last in launch_sites()
                    if not any(p == path and first <= line <= last for p, line in reached))
    for site in missed:
        failures += 1
        print(f"FAILED launch site {site}: reached by no case (add a case to engine_cases, or remove the launch)")
    depths = {d: sum(x.depth == d for x in launches) for d in ("cubin", "ttir", "same front end")}
    kernels = sorted({x.name for x in launches})
    print(f"sm_{args.arch}, triton {triton.__version__}: {len(runs)} cases, {len(launches)} launches, "
          f"{len({x.signature for x in launches})} distinct signatures: {depths['cubin']} compiled to a cubin, "
          f"{depths['ttir']} through the front end, {depths['same front end']} sharing a front end; "
          f"kernels: {', '.join(kernels)}; {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
