"""What one request took: token counts and times (plain bookkeeping, no tensors).

`as_dict` is the `timings` object of `bonsai generate --json`; `timings` is llama.cpp's, which the
server returns. Both come from the same counters, kept by the request's Sequence.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.speculative.stats import SpecStats


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not recomputed
    generated_tokens: int = 0
    prefill_seconds: float = 0.0  # from admission to the first token chosen (TTFT)
    decode_seconds: float = 0.0  # after the first token until the last
    speculative: SpecStats | None = None  # draft statistics when a drafter runs

    @property
    def ttft_seconds(self) -> float:
        return self.prefill_seconds

    @property
    def prefill_tokens_per_second(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        n = self.generated_tokens - 1
        return n / self.decode_seconds if self.decode_seconds > 0 and n > 0 else 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens, "prefill_seconds": self.prefill_seconds,
                "decode_seconds": self.decode_seconds, "ttft_seconds": self.ttft_seconds,
                "prefill_tokens_per_second": self.prefill_tokens_per_second,
                "decode_tokens_per_second": self.decode_tokens_per_second,
                **({"speculative": self.speculative.as_dict()} if self.speculative is not None else {})}

    def timings(self) -> dict[str, Any]:
        """llama.cpp's `timings` object."""
        prompt_n = self.prompt_tokens - self.cached_tokens
        prompt_ms, predicted_ms, predicted_n = self.prefill_seconds * 1000, self.decode_seconds * 1000, \
            self.generated_tokens
        spec = self.speculative
        return {"cache_n": self.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0,
                "predicted_per_second": 1000 * (predicted_n - 1) / predicted_ms if predicted_ms > 0 else 0.0,
                "draft_n": spec.drafted if spec else 0, "draft_n_accepted": spec.accepted if spec else 0}
