"""Speculative decoding in the engine: each slot's drafter, and one verification step that serves
every decoding slot together (one slot for `bonsai generate`, many for the server).

Each slot owns a drafter (engine.speculative.config.build_drafters: an n-gram pool, when configured,
is shared by all slots; any Drafter works). When a request takes the slot the drafter is begun on the
request's whole prompt, the part reused from the slot's cache included, and told the request's
sampling parameters.

One step, for the slots that decode (each has one pending token: the last one accepted):
  1. every slot's drafter proposes from its context (the slot's cached tokens + the pending one),
     at most k tokens, fewer near max_tokens or the end of the slot's context; where the rows run
     through the fused decode step (at most MAX_STEP_ROWS rows a call) the draft budget left after
     one row per slot is split fairly between the slots (`split_draft_budget`), and with several
     slots only the drafts that raise the whole pass's expected tokens per second are kept (each
     slot's recent acceptance vs the measured cost of the pass by row count: `joint_draft_lengths`);
  2. the target scores all rows: one `runner.step_rows` call over every slot's [pending, drafts]
     where the fused step exists; else `runner.verify` per slot that drafted and one batched
     `decode_batch` for the slots that did not (drafters that read hidden states always verify
     per slot, since they need the target's hidden rows);
  3. per slot: the rule of engine.speculative.verify (greedy: equal to the argmax, so the output is
     exactly plain greedy decoding's; sampling: min(1, p/q) and the residual, so the distribution is
     plain sampling's), the slot rewound past its rejected rows, the verified tokens taken one by
     one by the Sequence (stop strings, EOS, max_tokens, context, thinking budget cut exactly where
     plain decoding would stop), and the slot rewound again to hold what plain decoding's would:
     the tokens before the last one taken. So the slot's token list stays exactly what its KV
     holds, and prefix reuse keeps working with speculation.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.decoding.metrics import Metrics
from engine.decoding.grammar_match import apply_mask
from engine.decoding.sampling import apply_logit_bias, greedy_tokens
from engine.decoding.sequence import Sequence
from engine.decoding.spec_gate import SpecGate
from engine.runtime.decode_step import MAX_STEP_ROWS
from engine.runtime.runner import Runner
from engine.speculative.drafter import Draft, Drafter, Feedback
from engine.speculative.planner import Acceptance, TargetCost, joint_draft_lengths
from engine.speculative.stats import SpecStats
from engine.speculative.verify import accept_greedy, penalized_rows, verify_draft

log = logging.getLogger(__name__)


def split_draft_budget(wants: list[int], budget: int, first: int = 0) -> list[int]:
    """Draft tokens per slot when slot i wants wants[i] and at most `budget` fit in all: equal
    shares, each capped by what its slot wants, the unused part shared again among the others;
    an indivisible remainder goes one token each starting at index `first` (rotate it per step)."""
    out = [0] * len(wants)
    left = max(budget, 0)
    n = len(wants)
    order = [(first + j) % n for j in range(n)] if n else []
    while left > 0:
        hungry = [i for i in order if out[i] < wants[i]]
        if not hungry:
            break
        share = left // len(hungry)
        if share == 0:
            for i in hungry[:left]:
                out[i] += 1
            break
        for i in hungry:
            give = min(share, wants[i] - out[i])
            out[i] += give
            left -= give
    return out


@dataclass
class SlotDrafter:
    drafter: Drafter
    stats: SpecStats = field(default_factory=SpecStats)  # this slot's counters over all its requests

    def info(self, num_draft_tokens: int) -> dict[str, Any]:
        """What /slots shows of the slot's drafter."""
        s = self.stats
        out: dict[str, Any] = {"method": s.method, "num_draft_tokens": num_draft_tokens, "steps": s.steps,
                               "drafted": s.drafted, "accepted": s.accepted, "acceptance": s.acceptance,
                               "mean_accepted_length": s.mean_accepted_length}
        members = getattr(self.drafter, "members", None)
        if members:  # a mix (or one adaptive drafter): each member's running acceptance estimate
            out["members"] = [{"name": m.drafter.name, "acceptance_estimate": m.acceptance.rate} for m in members]
        return out


@dataclass
class _Row:
    """One slot's part of a step."""
    index: int
    seq: Sequence
    start: int  # the slot's length before the step
    draft: Draft
    tokens: list[int]  # the rows: the pending token, then the drafts
    logits: torch.Tensor | None = None  # [1 + drafts, V]
    hidden: dict[int, torch.Tensor] | None = None
    seconds: float = 0.0
    argmax: list[int] | None = None  # greedy rows without penalties: the target's choice per row


class SpeculativeStep:
    def __init__(self, runner: Runner, drafters: list[Drafter], num_draft_tokens: int, slot_context: int,
                 vocab: int, metrics: Metrics, method: str | None = None):
        """drafters: one per slot of runner; method: the name /slots shows (default: the drafter's)."""
        self.runner, self.num_draft_tokens, self.slot_context, self.vocab, self.metrics = \
            runner, num_draft_tokens, slot_context, vocab, metrics
        self.method = drafters[0].name
        self.slots = [SlotDrafter(d, SpecStats(method or d.name)) for d in drafters]
        self._steps = 0
        self._caught_up = (0.0, 0)  # of the step running: seconds and tokens drafters fed that they had not seen
        self._hold_back = False  # the gate's verdict for a mix: catching its model members up does not pay
        # batched speculation: the measured cost of a whole fused pass by its row count, and each
        # slot's recent acceptance, decide how many of the proposed drafts are worth their rows
        self.pass_cost = TargetCost()
        self.acceptance = [Acceptance() for _ in runner.cache.slots]

    def max_rows(self) -> int:
        """The widest fused step this config can ask for (to capture before serving)."""
        return min(MAX_STEP_ROWS, len(self.slots) * (self.num_draft_tokens + 1))

    def begin(self, index: int, seq: Sequence) -> None:
        """A request takes slot `index` (its reused prefix already in the slot)."""
        drafter = self.slots[index].drafter
        configure = getattr(drafter, "set_sampling", None)
        if configure is not None:
            configure(seq.request.sampling)
        drafter.begin(list(seq.request.prompt_ids))
        rows = getattr(drafter, "prompt_rows", 0)
        if rows:  # it takes in the prompt's hidden states: the runner keeps them while it prefills this slot
            self.runner.record_prompt_rows(index, rows)

    def info(self, index: int) -> dict[str, Any]:
        return self.slots[index].info(self.num_draft_tokens)

    # -- one step ------------------------------------------------------------------------------
    def gated(self, gate: SpecGate | None, active: dict[int, Sequence], indices: list[int]) -> bool:
        """Whether the step of the slots `indices` speculates (always, without a gate), as `gate` decides knowing
        what speculating costs first and could gain on: the tokens their drafters would feed before drafting (a
        prompt, plain steps' tokens: DraftModelDrafter.backlog) and the tokens the slots may still generate. A mix
        whose model member lags drafts with its other members (n-gram lookup) where catching up would not pay
        (`hold_back`)."""
        self._hold_back = False
        if gate is None:
            return True
        most = least = left = 0
        for i in indices:
            seq, drafter = active[i], self.slots[i].drafter
            if hasattr(drafter, "backlog"):
                length = self.runner.slot(i).length + len(seq.pending)
                most += drafter.backlog(length)
                least += getattr(drafter, "least_backlog", drafter.backlog)(length)
        if most:  # the tokens left matter only against a catch-up (draftless drafters: none, every step)
            left = sum(max(active[i].request.max_tokens - active[i].generated, 0) for i in indices)
        speculate = gate.speculate(len(indices), least, left)
        self._hold_back = speculate and most > least and not gate.worth(len(indices), most, left)
        return speculate

    def step(self, active: dict[int, Sequence], indices: list[int],
             fail: Callable[[int, Exception], None]) -> tuple[float, int]:
        """Draft, verify and accept for the slots `indices` (each with one pending token); the seconds the
        drafters spent catching up on tokens they had not seen (a prompt, the tokens of plain steps), and those
        tokens."""
        self._steps += 1
        self._caught_up = (0.0, 0)
        rows: list[_Row] = []
        for i in indices:
            if hasattr(self.slots[i].drafter, "hold_back"):
                self.slots[i].drafter.hold_back = self._hold_back
        for i, k in zip(indices, self._budgets(active, indices)):
            try:
                rows.append(self._propose(i, active[i], k))
            except Exception as e:  # noqa: BLE001 - a drafter that fails ends its own request only
                log.exception("drafting failed")
                fail(i, e)
        fused = [r for r in rows if self._fused(r)]
        if len(fused) > 1:
            self._trim(fused)
        if sum(len(r.tokens) for r in fused) > MAX_STEP_ROWS:  # more slots than one fused step takes (no
            fused = []  # drafts then): the batched plain path, as without speculation
        separate = [r for r in rows if r not in fused]
        try:
            if fused:
                self._run_fused(fused)
        except Exception as e:  # noqa: BLE001 - the rows of this call fail, the others go on
            log.exception("speculative step failed")
            for r in fused:
                fail(r.index, e)
            fused = []
        separate = self._run_separate(separate, fail)
        self._read_argmax(fused + separate)
        before = sum(r.seq.generated for r in fused + separate)
        for r in fused + separate:
            try:
                self._accept(r)
            except Exception as e:  # noqa: BLE001
                log.exception("accepting a speculative step failed")
                fail(r.index, e)
        after = sum(r.seq.generated for r in fused + separate)
        self.metrics.count_step(sum(len(r.tokens) for r in fused + separate), after - before)
        return self._caught_up

    def _wants(self, seq: Sequence, start: int) -> int:
        """Drafts that may join this slot's row: the pending token and the drafts must fit the
        slot's context, and no draft goes past max_tokens (the bonus always comes). None after the
        prompt's last token (left alone by a prefix reuse): the first token is sampled plainly, as
        after a prefill, so a seeded request starts the same whatever was cached."""
        if seq.first_token is None:
            return 0
        cap = seq.request.draft_tokens  # the request's own limit (speculative.n_max), if it set one
        k = self.num_draft_tokens if cap is None else min(self.num_draft_tokens, cap)
        return max(min(k, self.slot_context - start - 1, seq.request.max_tokens - seq.generated - 1), 0)

    def _budgets(self, active: dict[int, Sequence], indices: list[int]) -> list[int]:
        wants = [self._wants(active[i], self.runner.slot(i).length) for i in indices]
        if self.runner.decoder is None or any(self.slots[i].drafter.hidden_layers for i in indices):
            return wants  # rows per slot are separate passes: no shared row limit
        return split_draft_budget(wants, MAX_STEP_ROWS - len(indices), self._steps % max(len(indices), 1))

    def _propose(self, index: int, seq: Sequence, k: int) -> _Row:
        slot = self.runner.slot(index)
        context = slot.tokens + seq.pending  # prompt + output: what the slot holds and the pending token
        drafter = self.slots[index].drafter
        if getattr(drafter, "prompt_rows", 0):
            prompt = self.runner.take_prompt_rows(index)  # the prefill's rows, before the first proposal
            if prompt is not None:
                drafter.observe_prompt({-1: prompt})
        # asked even for k = 0: a drafter pairs each observe with a propose (a mix judges its members
        # by the spans of its last proposal; hidden-state drafters take in their new rows)
        draft = drafter.propose(context, k)
        seconds, tokens = self._caught_up
        self._caught_up = (seconds + getattr(drafter, "catch_up_seconds", 0.0),
                           tokens + getattr(drafter, "catch_up_tokens", 0))
        n = next((j for j, t in enumerate(draft.tokens[:k]) if t >= self.vocab), min(len(draft.tokens), k))
        if seq.grammar is not None:  # cut at the first draft the grammar refuses (it could never be accepted)
            n = seq.grammar.accept_prefix(draft.tokens[:n])
        if n < len(draft.tokens):  # at most k, none the tokenizer cannot print (a padded vocabulary)
            draft = Draft(draft.tokens[:n], draft.probs[:n] if draft.probs is not None else None,
                          draft.source, draft.sources[:n])
        return _Row(index, seq, slot.length, draft, seq.pending[:1] + draft.tokens)

    def _trim(self, rows: list[_Row]) -> None:
        """Keep the drafts that raise the expected tokens per second of the shared pass (each slot's
        own planner sized its draft as if it ran alone; in a batch every row costs all slots)."""
        keep = joint_draft_lengths([self.acceptance[r.index].rate for r in rows],
                                   [len(r.draft.tokens) for r in rows], self.pass_cost)
        for r, n in zip(rows, keep):
            if n < len(r.draft.tokens):
                d = r.draft
                r.draft = Draft(d.tokens[:n], d.probs[:n] if d.probs is not None else None, d.source, d.sources[:n])
                r.tokens = r.tokens[:1 + n]

    def _fused(self, row: _Row) -> bool:
        return self.runner.decoder is not None and not self.slots[row.index].drafter.hidden_layers

    def _run_fused(self, rows: list[_Row]) -> None:
        """Every row of every slot through one fused step (rows of a slot at consecutive positions)."""
        tokens = [t for r in rows for t in r.tokens]
        positions = [r.start + j for r in rows for j in range(len(r.tokens))]
        slot_ids = [r.index for r in rows for _ in r.tokens]
        for r in rows:
            if r.start + len(r.tokens) > self.runner.slot(r.index).capacity:
                raise AssertionError(f"slot {r.index}: {len(r.tokens)} rows past its capacity")
        begin = _settled(self.runner.device)
        logits = self.runner.step_rows(tokens, positions, slot_ids)  # [M, V]
        _sync(logits.device)  # the drafters' planners weigh the pass's real time
        seconds = time.perf_counter() - begin
        self.pass_cost.observe(len(tokens), seconds)
        offset = 0
        for r in rows:
            n = len(r.tokens)
            r.logits = logits[offset:offset + n]  # [n, V]
            r.seconds = seconds * n / len(tokens)  # the step's cost shared by rows
            self.runner.slot(r.index).tokens.extend(r.tokens)
            offset += n

    def _run_separate(self, rows: list[_Row], fail: Callable[[int, Exception], None]) -> list[_Row]:
        """Plain path: a verify pass per slot that drafts (or reads hidden states), one batched
        decode for the slots that do not. Returns the rows that ran."""
        done: list[_Row] = []
        plain = [r for r in rows if not r.draft.tokens and not self.slots[r.index].drafter.hidden_layers]
        for r in rows:
            if r in plain:
                continue
            try:
                begin = _settled(self.runner.device)
                layers = tuple(self.slots[r.index].drafter.hidden_layers)
                r.logits, r.hidden = self.runner.verify(self.runner.slot(r.index), r.tokens, layers)  # [T, V]
                _sync(r.logits.device)
                r.seconds = time.perf_counter() - begin
                done.append(r)
            except Exception as e:  # noqa: BLE001
                log.exception("speculative verify failed")
                fail(r.index, e)
        if plain:
            try:
                begin = _settled(self.runner.device)
                logits = self.runner.decode_batch([self.runner.slot(r.index) for r in plain],
                                                  [r.tokens[0] for r in plain])  # [B, V]
                _sync(logits.device)
                seconds = (time.perf_counter() - begin) / len(plain)
                for j, r in enumerate(plain):
                    r.logits, r.seconds = logits[j:j + 1], seconds  # [1, V]
                done += plain
            except Exception as e:  # noqa: BLE001
                log.exception("batched decode failed")
                for r in plain:
                    fail(r.index, e)
        return done

    def _read_argmax(self, rows: list[_Row]) -> None:
        """Greedy rows without penalties need only the target's argmax: read back in one transfer
        for all slots (one device sync a step, not one per slot)."""
        greedy = [r for r in rows if r.seq.request.sampling.greedy and not r.seq.adjusts and r.seq.grammar is None]
        if not greedy:
            return
        choices = greedy_tokens(*(r.logits[:, :self.vocab] for r in greedy))  # [rows], one read-back
        offset = 0
        for r in greedy:
            r.argmax = choices[offset:offset + r.logits.shape[0]]
            offset += r.logits.shape[0]

    def _accept(self, r: _Row) -> None:
        seq, slot, draft = r.seq, self.runner.slot(r.index), r.draft
        params = seq.request.sampling
        logits = r.logits[:, :self.vocab]  # [T, V] the ids the tokenizer knows
        if seq.seen is not None:
            logits = penalized_rows(logits, draft.tokens, seq.seen, seq.output, params)  # row i counts drafts[:i]
        if seq.bias is not None:
            logits = apply_logit_bias(logits, seq.bias)  # [T, V]
        if seq.grammar is not None:  # row i masked by the grammar's state after drafts[:i]
            logits = apply_mask(logits.clone(), seq.grammar.draft_masks(draft.tokens))  # [T, V]
        probs = draft.probs[:, :self.vocab] if draft.probs is not None else None  # [k, V]
        verdict = (accept_greedy(r.argmax, draft.tokens) if r.argmax is not None
                   else verify_draft(logits, draft.tokens, probs, params, seq.generator))
        k, a = len(draft.tokens), verdict.accepted
        slot.rewind(k - a)  # the slot holds its rows up to the last accepted draft
        self.slots[r.index].stats.record(draft.sources, a)
        if k:
            self.acceptance[r.index].update(a, a < k)
        self.metrics.count_spec(k, a)
        seq.stats.speculative.record(draft.sources, a)
        used = seq.accept(verdict.tokens, logits[:a + 1], self.slot_context - r.start - 1)
        slot.rewind(a - (used - 1))  # as after plain decoding: every token before the last one taken
        kept = {i: h[:a + 1] for i, h in r.hidden.items()} if r.hidden else None
        self.slots[r.index].drafter.observe(Feedback(draft, a, verdict.bonus, kept, r.seconds))


def _settled(device: torch.device) -> float:
    """The clock once the device's queued work is done: a pass is timed alone, not with this iteration's prompt chunks
    (launched asynchronously) or a dropped step launched ahead; timed with them, passes of 1-5 rows measured 2.5-9.4
    ms for 1.7-2.5, and the planner cut the drafts (4 slots, H100: 738 speculative steps kept 91, 2026-12-06)."""
    _sync(device)
    return time.perf_counter()


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a measured time is real."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
