"""A smaller (or quantized) model that shares the target's tokenizer drafts k tokens one by one.

It has its own ModelRunner and KV cache. Before each proposal its cache keeps the longest prefix
it shares with the context (so the drafted tokens the target rejected are rewound) and catches up
on the accepted tokens it has not seen. At temperature 0 it drafts its argmax; at T > 0 it samples
from its own distribution under the request's temperature / top-k / top-p / min-p and returns it
as q, which verification needs to stay lossless (penalties are left to the target: any q works).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from engine.errors import BonsaiError
from engine.weights.loader import LoadedModel
from engine.runtime.runner import ModelRunner
from engine.decoding.sampling import SamplingParams, probabilities
from engine.speculative.drafter import Draft, Feedback
from engine.sources.tokenizer import Tokenizer


def resolve_draft_model(spec: str) -> Path:
    """The file or directory of `draft:SPEC`: a path, or a model name known to the store (a pulled
    built-in like qwen2.5-coder-0.5b, or a pulled hub repo id)."""
    from engine.sources import store
    try:
        return store.resolve_model(spec)
    except BonsaiError as e:
        raise BonsaiError(f"draft model: {e}") from None


def narrow_output_layer(loaded: LoadedModel) -> None:
    """On the CPU, a draft model's float32 output layer as int8 codes (engine.runtime.narrow_head.Int8Linear,
    where torch's int8 kernel is fast) or in its matrices' dtype (float16): a drafter's logits need not be
    exact (verification keeps the output exact), and at 0.5B the float32 output layer is as many bytes per
    token as all the other matrices."""
    from engine.runtime.narrow_head import Int8Linear, int8_head_usable
    head = loaded.model.lm_head
    weight = getattr(head, "weight", None)  # None: tied, or packed
    if loaded.device.type != "cpu" or weight is None or weight.dtype != torch.float32 \
            or loaded.weight_dtype == torch.float32:
        return
    if getattr(head, "bias", None) is None and int8_head_usable():
        loaded.model.lm_head = Int8Linear(weight.data)
    else:
        weight.data = weight.data.to(loaded.weight_dtype)


def check_same_tokenizer(draft: Tokenizer | None, target: Tokenizer | None, draft_path: str) -> None:
    """One line if the draft model cannot draft for the target (its token ids mean other text)."""
    if draft is None or target is None:
        raise BonsaiError(f"draft model {draft_path}: a draft model and its target both need a tokenizer "
                          "(generated-weight models have none)")
    mine, theirs = draft.vocabulary(), target.vocabulary()
    if mine != theirs:
        differ = sum(1 for tok, i in theirs.items() if mine.get(tok) != i) + len(set(mine) - set(theirs))
        raise BonsaiError(f"draft model {draft_path} has another tokenizer than the target ({len(mine)} vs "
                          f"{len(theirs)} tokens, {differ} differ): use a draft model of the same family")


STEADY_CATCH_UP = 2  # tokens a draft model feeds before drafting when it drafted the step before


class DraftModelDrafter:
    """catch_up_seconds / catch_up_tokens: of the last proposal, the time spent feeding a gap longer than one
    step's and its tokens (the planner leaves it out of the cost per drafted token; the gate charges it once)."""
    name = "draft"
    hidden_layers: tuple[int, ...] = ()
    draftless = False

    def __init__(self, loaded: LoadedModel, target_vocab_size: int, max_seq_len: int,
                 sampling: SamplingParams | None = None):
        if loaded.config.hybrid is not None:  # a drafter's slot goes back to any common prefix; a DeltaNet state cannot
            raise BonsaiError(f"{loaded.path.name} is a hybrid (DeltaNet) model, which cannot draft yet: "
                              "use a Llama/Qwen2/Qwen3 drafter or --spec ngram")
        self.loaded = loaded
        self.runner = ModelRunner(loaded, max_seq_len=max_seq_len, prefill_graphs=False)  # its memory is planned without them
        self.vocab_size = target_vocab_size
        self.sampling = sampling or SamplingParams()
        self.generator: torch.Generator | None = None
        self._pending: tuple[int, list[int]] | None = None  # (context length, tokens) of the last draft
        self.catch_up_seconds = 0.0
        self.catch_up_tokens = 0
        self._held = 0  # leading tokens of the request's context its slot holds, known without a scan

    def set_sampling(self, params: SamplingParams) -> None:
        """The request's sampling parameters; a seeded request drafts reproducibly."""
        self.sampling = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=self.runner.device)
            if params.seed is None:
                self.generator.seed()
            else:  # a stream apart from the verifier's: its uniforms must not follow the draft's
                self.generator.manual_seed((params.seed * 1_000_003 + 7) % 2**63)

    def begin(self, prompt: list[int]) -> None:
        self._pending = None
        self._held = self.runner.slot(0).common_prefix(prompt)  # what is left of an earlier request

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [V_draft] → [V_target] (padded vocabularies may differ in size)."""
        v = self.vocab_size
        if logits.shape[-1] >= v:
            return logits[:v]
        pad = torch.full((v - logits.shape[-1],), float("-inf"), device=logits.device, dtype=logits.dtype)
        return torch.cat([logits, pad])  # [V]

    def backlog(self, length: int) -> int:
        """The tokens a proposal for a context of `length` tokens would feed first beyond a drafting step's own
        (0 then): the prompt, plain steps' tokens. O(1): after a proposal its slot holds the context and all
        drafts but the last; a rejected draft only makes this smaller than the feed."""
        gap = length - self._held
        return gap if gap > STEADY_CATCH_UP else 0

    def propose(self, context: list[int], k: int) -> Draft:
        slot = self.runner.slot(0)
        k = min(k, slot.capacity - len(context))
        if k <= 0 or not context:
            return Draft([], source=self.name)
        common = min(slot.common_prefix(context), len(context) - 1)
        slot.rewind(slot.length - common)
        start = time.perf_counter()
        logits = self._fit(self.runner.prefill(slot, context[common:]))  # [V]
        # drafting every step leaves at most two tokens to catch up (its last draft and the bonus); a
        # longer gap is the prompt or plain steps the planner chose, not a cost of the tokens drafted now
        gap = len(context) - common
        self.catch_up_seconds = time.perf_counter() - start if gap > STEADY_CATCH_UP else 0.0
        self.catch_up_tokens = gap if gap > STEADY_CATCH_UP else 0
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        params = self.sampling
        for i in range(k):
            if params.greedy:
                token = int(torch.argmax(logits))
            else:
                q = probabilities(logits, params)  # [V]
                token = int(torch.multinomial(q, 1, generator=self.generator))
                probs.append(q)
            tokens.append(token)
            if i + 1 < k:
                logits = self._fit(self.runner.forward(slot, [token])[-1])
        self._pending = (len(context), tokens)
        self._held = len(context) + max(len(tokens) - 1, 0)
        return Draft(tokens, torch.stack(probs) if probs else None, self.name)  # probs [k, V]

    def observe(self, feedback: Feedback) -> None:
        """Rewind the cache past this drafter's rejected tokens (when its draft was the one verified)."""
        if self._pending is None:
            return
        context_len, tokens = self._pending
        self._pending = None
        if feedback.draft.tokens[:len(tokens)] != tokens:
            return  # another member's draft: the next proposal realigns by common prefix
        slot = self.runner.slot(0)
        keep = context_len + feedback.accepted
        if slot.length > keep:
            slot.rewind(slot.length - keep)
