"""The server's engine: the run opened from the serve config, and the thread that steps its engine.

`bonsai serve` runs `start_serving` in a background thread (GET /health reports the stage meanwhile);
from then on one thread owns the runner and calls `Engine.step` while any request is active or
waiting, and sleeps otherwise (the API's `submit` / `cancel` wake it). Should that loop break anyway
(the engine fails one request at a time, so only a bug or a BaseException gets here), the thread
says why (`engine.failure`, which /health reports) and closes the engine: every active and waiting
request fails with 503 at once and new ones are refused.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from engine.decoding.engine import Engine
from engine.decoding.metrics import Metrics
from engine.errors import first_line
from engine.run.builder import Progress, Run, open_run
from engine.server.config import ServeConfig
from engine.weights.format_cost import warn_if_rounded

log = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="bonsai-engine", daemon=True)

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, end the running ones (503) and let the thread exit."""
        with self.engine.lock:
            self.engine.closed = True
            self._stopping = True
            self.engine.wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and takes requests (/health is 503 otherwise)."""
        return self.engine.failure is None and self._thread.is_alive() and not self._stopping

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with engine.wake:
                    while not self._stopping and not engine.has_work:
                        engine.wake.wait()
                    if self._stopping:
                        break
                engine.step()
        except BaseException as e:  # noqa: BLE001 - the loop itself broke: nothing may wait on it now
            engine.failure = f"the engine stopped after an internal error ({type(e).__name__}: {first_line(e)})"
            log.critical("%s; restart the server", engine.failure, exc_info=True)
        finally:
            engine.close(engine.failure or "the server is shutting down")


@dataclass
class Served:
    engine: Engine
    thread: EngineThread
    model_id: str
    config: ServeConfig
    run: Run | None = None  # None: an engine over a runner the caller owns (tests)

    @property
    def alive(self) -> bool:
        return self.thread.alive

    def stop(self) -> None:
        self.thread.stop()
        if self.run is not None:
            self.run.close()


def start_serving(config: ServeConfig, metrics: Metrics | None = None,
                  progress: Progress = lambda stage, fraction: None, architecture=None) -> Served:
    """open_run, then its engine (the server section's queue and prefill budget) on its own thread."""
    run = open_run(config, architecture, progress=progress)
    try:
        m = config.model
        if m.load_format != "dummy" and run.pipeline is None:  # rounding to model.quant_type is never silent
            warn_if_rounded(run.loaded.path, m.quant_type, m.group_size, keep_codes=run.loaded.device.type == "cuda")
        spec, rt = config.spec_config, config.runtime
        progress(f"building each slot's drafter ({spec.method})" if spec is not None else "starting the engine", 0.9)
        engine = run.engine(metrics, config.server.max_queue, config.server.max_prefill_tokens_per_step,
                            mixed_prefill=config.server.mixed_prefill)
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
    return Served(engine, EngineThread(engine).start(), run.name, config, run)
