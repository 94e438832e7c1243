"""Grid dependency control for programmatic dependent launch (see `quant.kernels.pdl_enabled`).

Kernels call these under a `USE_PDL` constexpr. Where this Triton lacks them, no-op stand-ins keep
the kernels compiling (PDL is then reported unsupported and never switched on).
"""
import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton: never called (pdl_enabled() is False), only referenced
    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = ["gdc_launch_dependents", "gdc_wait"]
