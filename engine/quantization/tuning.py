"""`bonsai quantize --tune-scales`: end-to-end scale tuning of a written checkpoint, then the checkpoint again.

engine.quantization.scale_tuning trains every group scale of every quantized tensor on the KL to the float model
with the codes fixed; it needs both models whole on the device (the quantized student read back from
the checkpoint just written, the float teacher from the source), so unlike the layer loop its memory
grows with the model: twice the model in float32, for GPUs and small models. The tuned scales are
written into a second checkpoint directory (codes and every other tensor copied), which replaces the
first.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import torch

from engine.quantization.layerwise import LayerwiseInputs
from engine.quantization.float_source import FloatSource
from quant.checkpoint import INDEX_FILE, Checkpoint, CheckpointWriter


def tune_checkpoint(writer: CheckpointWriter, floats: FloatSource, config, job: LayerwiseInputs, opts,
                    rotation: dict | None, say: Callable[[str], None]) -> tuple[CheckpointWriter, dict]:
    """Tune the scales of the checkpoint `writer` has finished; returns the writer of the tuned checkpoint
    (to commit; the first one is removed) and the tuning report."""
    from engine.weights.loader import load_model, model_from_tensors, resolve_device
    from engine.quantization.scale_tuning import ScaleTuningOptions, tune_scales
    dev = resolve_device(opts.device)
    first = writer.finish()
    checkpoint = Checkpoint(first)
    student = load_model(first, device=dev, dtype=torch.float32, weight_dtype=torch.float32, keep_codes=False)
    teacher = model_from_tensors(config, ((n, floats.read(n)) for n in floats.shapes), dev, torch.float32,
                                 torch.float32, floats.source.path, down_hadamard=job.down_block)
    quantized = {}
    for name, entry in checkpoint.entries.items():
        if not entry.is_float:
            spec, codes, scales = checkpoint.read_quantized(name)
            quantized[name] = (codes, scales, spec)
    sequences = [list(s) for s in job.calibration]
    tuned, report = tune_scales(student.model, teacher, sequences, quantized,
                                ScaleTuningOptions(steps=opts.tune_steps, lr=opts.tune_lr), dev, say)
    del student, teacher
    second = CheckpointWriter(writer.out, force=writer.force, rotation=rotation)
    try:
        for path in sorted(first.iterdir()):
            if path.is_file() and path.suffix != ".safetensors" and path.name != INDEX_FILE:
                second.copy_file(path.name, path)
        for name, entry in checkpoint.entries.items():
            if entry.is_float:
                second.write_float(name, checkpoint.read_float(name), entry.quant_type)
            else:
                codes, _, spec = quantized[name]
                second.write_quantized(name, spec, codes, tuned[name])
    except BaseException:
        second.abort()
        raise
    writer.abort()
    return second, asdict(report)
