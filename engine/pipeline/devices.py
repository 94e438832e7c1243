"""The device list of a pipeline-parallel run, checked before anything loads.

`cuda:0,cuda:1` puts one stage on each GPU (NCCL between them); `cpu,cpu` runs two CPU processes
(gloo between them: the same code, for tests and machines without GPUs). One line names what is
wrong: a device that does not exist, fewer GPUs than listed, the same GPU twice, CPU and CUDA mixed,
NCCL unavailable.
"""
from __future__ import annotations

from engine.errors import BonsaiError

UNSUPPORTED_DRAFTERS = ("mtp", "dflash")  # they read the target's hidden states and its embedding / head


def device_list(device: str) -> list[str]:
    """'cuda:0, cuda:1' → ['cuda:0', 'cuda:1']."""
    return [d.strip() for d in str(device).split(",") if d.strip()]


def check_devices(devices: list[str], cuda_count: int, nccl: bool, distributed: bool = True) -> str:
    """The torch.distributed backend of a pipeline over `devices` (gloo for CPUs, nccl for GPUs), or
    a BonsaiError. cuda_count / nccl / distributed: what this machine has (given, so this is pure)."""
    if len(devices) < 2:
        raise BonsaiError(f"pipeline parallelism needs at least two devices, got '{','.join(devices)}': "
                          "list them, e.g. cuda:0,cuda:1 (or cpu,cpu for two CPU processes)")
    if not distributed:
        raise BonsaiError("pipeline parallelism needs torch.distributed, which this torch build lacks")
    kinds = set()
    for d in devices:
        kind, _, index = d.partition(":")
        if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
            raise BonsaiError(f"unsupported device '{d}' in the device list: use cuda:N (or cpu)")
        if kind == "cuda" and not index:
            raise BonsaiError(f"give each GPU of a pipeline its index ('{d}' is ambiguous): e.g. cuda:0,cuda:1")
        kinds.add(kind)
    if len(kinds) > 1:
        raise BonsaiError(f"the device list '{','.join(devices)}' mixes CPU and CUDA: a pipeline runs on GPUs "
                          "only (cuda:0,cuda:1) or on CPU processes only (cpu,cpu)")
    if kinds == {"cpu"}:
        return "gloo"
    seen = set()
    for d in devices:
        if d in seen:
            raise BonsaiError(f"{d} is listed twice: each pipeline stage needs its own GPU")
        seen.add(d)
    if cuda_count == 0:
        raise BonsaiError(f"the device list '{','.join(devices)}' names GPUs but no CUDA GPU is available "
                          "(install the CUDA build of torch, or use cpu,cpu)")
    missing = [d for d in devices if int(d.split(":")[1]) >= cuda_count]
    if missing:
        raise BonsaiError(f"device {missing[0]} does not exist: this machine has {cuda_count} CUDA GPU(s) "
                          f"(cuda:0..cuda:{cuda_count - 1}) but the pipeline lists {len(devices)}")
    if not nccl:
        raise BonsaiError("pipeline parallelism on GPUs needs NCCL, which this torch build lacks "
                          "(install a CUDA build of torch with NCCL)")
    return "nccl"


def check_machine_devices(devices: list[str]) -> str:
    """check_devices with what this machine has."""
    import torch
    import torch.distributed as dist
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    available = dist.is_available()
    return check_devices(devices, cuda, available and dist.is_nccl_available(), available)


def check_pipeline_request(device: str, pipeline_parallel: bool, where: str = "runtime.device",
                           flag: str = "memory.pipeline_parallel: true") -> list[str] | None:
    """The device list of a run when it is a pipeline (None: one device). A list without the
    pipeline flag, or the flag with one device, is an error naming the setting to change."""
    devices = device_list(device)
    if len(devices) > 1 and not pipeline_parallel:
        raise BonsaiError(f"{where} lists {len(devices)} devices ({','.join(devices)}): set {flag} to split "
                          "the model's layers across them, or give one device")
    if pipeline_parallel and len(devices) < 2:
        raise BonsaiError(f"{flag.split(':')[0]} needs two or more devices in {where} (e.g. cuda:0,cuda:1, "
                          f"or cpu,cpu), got '{device}'")
    return devices if pipeline_parallel else None


def check_pipeline_drafters(spec_config) -> None:
    """The drafters a pipeline cannot run (a SpeculativeConfig, or None), refused before anything loads
    (weight and KV offload are refused by the run config's memory section)."""
    for d in spec_config.drafters if spec_config is not None else ():
        if d.method in UNSUPPORTED_DRAFTERS:
            raise BonsaiError(f"speculative {d.method} reads the target's hidden states, which pipeline "
                              "parallelism spreads over devices; use ngram or draft:PATH")
