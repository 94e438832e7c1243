"""The server's own config: the `server:` section of serve.yaml on top of the run config.

ServeConfig is a RunConfig (engine/run/config.py: model, runtime, memory, speculative, thinking,
context) with the server section; `bonsai serve` builds it from the YAML (bonsai_cli/cmd_serve.py)
and hands its run part to engine.run.builder.open_run. Same rules as every section: an unknown key
names the nearest valid one, a wrong value names its key.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.run.config import RunConfig, fail


@dataclass(frozen=True)
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # Bearer key checked on every route but /health
    max_queue: int = 16  # requests waiting for a slot; beyond, 503 with Retry-After
    max_body_bytes: int = 1 << 20
    max_messages: int = 2048  # messages of one chat request (older turns beyond the context are dropped, not refused)
    max_prompt_chars: int = 1_000_000  # characters of one request's messages or prompt, before any template work
    max_prompt_tokens: int | None = None  # default: the slot's context budget
    default_max_tokens: int = 512  # when a request gives no max_tokens (capped by the context)
    # prompt tokens prefilled between two decode steps while other slots decode (default: one
    # runtime.prefill_chunk_size chunk; a smaller budget also cuts smaller chunks); smaller: steadier
    # tokens for the running requests, later first tokens for new ones
    max_prefill_tokens_per_step: int | None = None
    # while slots decode, a short prompt (up to 128 tokens left) rides in the rows the decode step's fused
    # pass leaves free instead of running passes of its own: the running requests wait for no prefill
    # (where the step is CUDA-graphed and nothing speculates; max_prefill_tokens_per_step then applies
    # to the longer prompts)
    mixed_prefill: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            fail("server.port", f"must be in 0..65535, got {self.port}")
        if self.api_key is not None and len(self.api_key) < 8:
            fail("server.api_key", "is shorter than 8 characters; use a longer random key")
        if self.max_queue < 0:
            fail("server.max_queue", f"must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            fail("server.max_body_bytes", f"must be >= 1024, got {self.max_body_bytes}")
        if self.max_messages < 1 or self.max_prompt_chars < 1:
            fail("server.max_messages" if self.max_messages < 1 else "server.max_prompt_chars", "must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            fail("server.max_prompt_tokens", f"must be >= 1, got {self.max_prompt_tokens}")
        if self.default_max_tokens < 1:
            fail("server.default_max_tokens", f"must be >= 1, got {self.default_max_tokens}")
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step < 1:
            fail("server.max_prefill_tokens_per_step", f"must be >= 1, got {self.max_prefill_tokens_per_step}")


@dataclass(frozen=True)
class ServeConfig(RunConfig):
    server: ServerSection = field(default_factory=ServerSection)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model.load_format == "dummy" and not self.model.tokenizer:
            fail("model.tokenizer", "is required to serve load_format: dummy (generated weights have no "
                 "tokenizer); give a model such as smollm2-135m")
