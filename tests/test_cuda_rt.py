"""quant.kernels.cuda_rt: CUDA C++ compiled by NVRTC without a GPU (sm_90 and sm_86, every variant the engine and
the issue-19 probe launch), NVRTC's log in the error, the driver structs' layout against cuda.h; on a GPU, launches (with and
without PDL, inside a CUDA graph) against the exact reference."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from quant.kernels import cuda_rt
from quant.kernels.cuda_gemv import SOURCE, defines, engine_variants
from tests.perf.cuda_gemv_probe import CONFIGS

ROOT = Path(__file__).resolve().parents[1]
LOCAL_NVRTC = ROOT / ".venv" / "nvrtc" / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"  # make install's


@pytest.fixture
def nvrtc_lib(monkeypatch):
    """NVRTC from make install's .venv/nvrtc (or the system's); skip where there is none."""
    if LOCAL_NVRTC.is_file() and not os.environ.get("BONSAI_NVRTC"):
        monkeypatch.setenv("BONSAI_NVRTC", str(LOCAL_NVRTC))
    cuda_rt.nvrtc.cache_clear()
    try:
        cuda_rt.nvrtc()
    except cuda_rt.CudaCompileError as e:
        pytest.skip(str(e).splitlines()[0])
    yield
    cuda_rt.nvrtc.cache_clear()


@pytest.mark.parametrize("arch", [90, 86])
def test_the_one_row_kernel_compiles_in_every_variant_the_engine_and_the_probe_launch(nvrtc_lib, arch):
    variants = engine_variants(arch)
    assert {(v["BITS"], v["USE_PDL"]) for v in variants} == ({(2, 0), (1, 0), (2, 1), (1, 1)} if arch >= 90
                                                              else {(2, 0), (1, 0)})  # griddepcontrol is sm_90's
    for kind in ("tri", "bin"):
        for warps, gpw in CONFIGS:
            for pdl in ((False, True) if arch >= 90 else (False,)):
                variants.append(defines(kind, warps, gpw, pdl, floor=True))
    for flags in variants:
        cubin = cuda_rt.compile_cubin(SOURCE, arch, flags)
        assert cubin[:4] == b"\x7fELF", flags


def test_pdl_instructions_need_sm_90(nvrtc_lib):
    with pytest.raises(cuda_rt.CudaCompileError, match="griddepcontrol|sm_90|not supported"):
        cuda_rt.compile_cubin(SOURCE, 86, defines("tri", 8, 1, pdl=True))


def test_a_broken_source_raises_with_nvrtcs_log(nvrtc_lib):
    source = 'extern "C" __global__ void k(int* out) { out[0] = no_such_function(); }'
    with pytest.raises(cuda_rt.CudaCompileError) as e:
        cuda_rt.compile_cubin(source, 90, name="broken.cu")
    assert "broken.cu" in str(e.value) and "no_such_function" in str(e.value)


def test_a_missing_nvrtc_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("BONSAI_NVRTC", str(tmp_path / "libnvrtc.so.99"))
    monkeypatch.setattr(cuda_rt, "_nvrtc_candidates", lambda: [str(tmp_path / "libnvrtc.so.99")])
    cuda_rt.nvrtc.cache_clear()
    try:
        with pytest.raises(cuda_rt.CudaCompileError, match="NVRTC .libnvrtc. was not found.*BONSAI_NVRTC"):
            cuda_rt.nvrtc()
    finally:
        cuda_rt.nvrtc.cache_clear()


def test_the_environment_names_the_library_first(monkeypatch, tmp_path):
    monkeypatch.setenv("BONSAI_NVRTC", "/some/libnvrtc.so.12")
    assert cuda_rt._nvrtc_candidates()[0] == "/some/libnvrtc.so.12"


def test_launch_structs_match_cuda_h():
    """CUlaunchAttribute {id; pad[4]; union of 64 bytes} and CUlaunchConfig {7 unsigned; CUstream; attrs; numAttrs}
    on a 64-bit host, as cuda.h (CUDA 12 and 13) lays them out."""
    assert ctypes.sizeof(cuda_rt._LaunchAttribute) == 72 and cuda_rt._LaunchAttribute.value.offset == 8
    cluster = cuda_rt._cluster_attribute((1, 16, 1))  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: {x, y, z} unsigned
    assert cluster.id == 4 and bytes(cluster)[8:20] == bytes((ctypes.c_uint * 3)(1, 16, 1))
    config = cuda_rt._LaunchConfig
    assert (config.shared.offset, config.stream.offset, config.attrs.offset, config.num_attrs.offset) == (24, 32, 40, 48)
    assert ctypes.sizeof(config) == 56
    attr = cuda_rt._pdl_attribute()
    assert attr.id == 6 and ctypes.string_at(ctypes.addressof(attr) + 8, 8) == (1).to_bytes(8, "little")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["tri", "bin"])
def test_the_probe_kernel_launches_equal_the_reference(kind):
    from quant.kernels.act_quant import quantize_activations
    from quant.kernels.packed_gemv import packed_gemv_reference
    from quant.packed_layout import random_packed
    from tests.perf.cuda_gemv_probe import CudaGemv
    dev = torch.device("cuda")
    pw = random_packed(kind, 640, 1024, 128, device=dev, generator=torch.Generator(dev).manual_seed(0))
    pw.scales.uniform_(0.5, 1.5)
    xq = quantize_activations(torch.randn(1, 1024, device=dev), 128)
    want = packed_gemv_reference(*xq, pw)
    for pdl in (False, True) if torch.cuda.get_device_capability()[0] >= 9 else (False,):
        out = torch.zeros(1, 640, device=dev)
        call = CudaGemv(kind, 4, 1, pdl=pdl).bind(xq, pw, out)
        call()
        torch.cuda.synchronize()
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
        graph = torch.cuda.CUDAGraph()
        out.zero_()
        with torch.cuda.graph(graph):
            call()
        out.zero_()
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out, 2 * want, rtol=1e-5, atol=2e-4 * want.abs().max().item())
