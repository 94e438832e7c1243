"""The server's side of the engine: the run opened from the serve config, its engine started.

`bonsai serve` runs `start_serving` in a background thread (GET /health reports the stage meanwhile).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.decoding.engine import EngineLoop
from engine.decoding.metrics import Metrics
from engine.decoding.sequence import ThinkingRules
from engine.run.builder import Progress, Run, open_run
from engine.server.config import ServeConfig

log = logging.getLogger(__name__)


@dataclass
class Served:
    engine: EngineLoop
    model_id: str
    config: ServeConfig
    run: Run


def start_serving(config: ServeConfig, metrics: Metrics | None = None,
                  progress: Progress = lambda stage, fraction: None, architecture=None) -> Served:
    """open_run, then the engine over its slots (with the server section's queue and prefill budget)."""
    run = open_run(config, architecture, progress=progress)
    try:
        spec, th, rt = config.spec_config, config.thinking, config.runtime
        if spec is not None:
            progress(f"building each slot's drafter ({spec.method})", 0.9)
        engine = EngineLoop(run.runner, run.tokenizer, run.slot_context, config.server.max_queue,
                            ThinkingRules(th.start_tag, th.end_tag, th.end_message), metrics, speculative=spec,
                            prefill_budget=config.server.max_prefill_tokens_per_step)
        # capture the fused step for every row count in use now, not mid-request
        run.runner.prepare_rows(engine.spec.max_rows() if engine.spec is not None else rt.max_batch_size)
    except BaseException:
        run.close()
        raise
    cache = run.runner.cache
    where = f"pipelined over {', '.join(rt.devices)}" if run.pipeline is not None else f"on {rt.device}"
    log.info("serving %s: %d slots of %d tokens %s (KV cache %s, %.1f MB%s)%s%s", run.name, rt.max_batch_size,
             engine.slot_context, where, cache.kv_type.name, cache.nbytes / 1e6,
             " in host memory" if config.memory.kv_offload else "",
             " with block weights streamed from host memory" if run.runner.weight_stream is not None else "",
             f", speculative {spec.method} k={spec.num_draft_tokens} per slot" if spec is not None else "")
    progress("ready", 1.0)
    return Served(engine.start(), run.name, config, run)
