"""MTP and DFlash drafters on the tiny random model: drafting with their own caches equals the
whole-sequence training forward, the greedy loop they run in equals plain decoding, their files
round-trip and are refused for another model or a too-long draft."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.errors import BonsaiError
from engine.weights.loader import LoadedModel, TensorSummary
from engine.runtime.runner import ModelRunner
from engine.decoding.sampling import SamplingParams
from engine.speculative import dflash, mtp
from engine.speculative.draft_layers import default_config, shared_logits
from engine.speculative.drafter import Draft, Drafter
from engine.speculative.drafter_eval import AcceptanceStats, count_accepted
from engine.speculative.drafter_file import TargetIdentity, save_drafter
from tests.engine_runs import run_engine
from tests.test_kv_cache import TINY, tiny_model

PROMPT = [5, 17, 3, 42, 8, 11, 60, 2]


def tiny_loaded(cfg=TINY) -> LoadedModel:
    return LoadedModel(model=tiny_model(cfg), tokenizer=None, config=cfg, path=Path("tiny"),
                       summary=TensorSummary("test", 0, 0, 0), device=torch.device("cpu"),
                       dtype=torch.float32, weight_dtype=torch.float32)


def random_module(kind: str, block_size: int = 3, num_layers: int = 2):
    """Every weight random (a trained drafter's zero-initialized residual outputs would hide bugs)."""
    cfg = default_config(kind, TINY, block_size=block_size, num_layers=num_layers)
    module = (mtp.MTPModule if kind == "mtp" else dflash.DFlashModule)(cfg, TINY.vocab_size)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module.eval()


def plain_greedy(loaded, prompt, n):
    runner = ModelRunner(loaded, max_seq_len=64)
    slot = runner.slot(0)
    out = [int(runner.prefill(slot, prompt).argmax())]
    while len(out) < n:
        out.append(int(runner.forward(slot, [out[-1]])[-1].argmax()))
    return out


def greedy_speculative(runner, drafter, prompt, n, k, stats: AcceptanceStats | None = None) -> list[int]:
    """n tokens greedy through the engine with `drafter` proposing up to k per step (stats: its acceptance)."""
    _, out, _, run = run_engine(runner, None, prompt, drafter=drafter, k=k, max_tokens=n, ignore_eos=True, text=False)
    if stats is not None:
        stats.add(run.speculative)
    return out


class OracleMix:
    """Proposes a known continuation accepted for a varying number of tokens (then a wrong one)
    while the drafter under test proposes too and sees every outcome, as inside a mix."""

    def __init__(self, inner, continuation):
        self.inner, self.continuation, self.turn = inner, continuation, 0
        self.name, self.hidden_layers = "oracle", inner.hidden_layers

    def begin(self, prompt):
        self.inner.begin(prompt)

    def propose(self, context, k):
        self.inner.propose(context, k)
        done = len(context) - len(PROMPT)
        good = min(self.turn % (k + 1), k)
        self.turn += 1
        tokens = self.continuation[done:done + good]
        if len(tokens) < k:
            tokens.append((self.continuation[done + len(tokens)] + 1) % TINY.vocab_size)
        return Draft(tokens[:k], None, self.name)

    def observe(self, feedback):
        self.inner.observe(feedback)


def target_hidden(loaded, tokens, layers):
    """{layer: [T, H]} of the target over `tokens` from an empty cache (the reference)."""
    runner = ModelRunner(loaded, max_seq_len=64)
    _, hidden = runner.verify(runner.slot(0), tokens, layers)
    return hidden


def test_pure_pieces(one_thread):
    assert count_accepted([1, 2, 3], [1, 2, 4, 9]) == 2
    assert count_accepted([], [7]) == 0
    stats = AcceptanceStats()
    stats.record(3, 2)
    stats.record(2, 0)
    stats.record(0, 0)  # no draft: not a drafting step
    assert (stats.drafted, stats.accepted, stats.steps) == (5, 2, 2)
    assert stats.mean_accepted_length == 2.0 and stats.acceptance_rate == pytest.approx(0.4)
    assert stats.as_dict()["acceptance_per_position"] == [0.5, 0.5, 0.0]
    masks = mtp.train_masks(torch.tensor([1]), 4, 2)[0, 0]  # [4, 8]
    assert masks[2].tolist() == [False, True, True, False, False, False, True, False]
    assert masks[0, 0]  # a row before the start still sees itself
    block = dflash.train_mask(torch.tensor([1]), torch.tensor([[3, 5]]), 6, 1)[0, 0]  # [4, 6 + 4]
    assert block[0].tolist() == [False, True, True, False, False, False] + [True, True, False, False]
    assert block[3].tolist() == [False, True, True, True, True, False] + [False, False, True, True]


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_drafting_with_own_cache_equals_the_training_forward(kind, one_thread):
    loaded = tiny_loaded()
    module = random_module(kind)
    k = module.cfg.block_size
    drafter = (mtp.MTPDrafter if kind == "mtp" else dflash.DFlashDrafter)(
        module, loaded, max_seq_len=64, sampling=SamplingParams(temperature=1.0, seed=0))
    assert isinstance(drafter, Drafter)
    runner = ModelRunner(loaded, max_seq_len=64)
    stats = AcceptanceStats()
    expected = plain_greedy(loaded, PROMPT, 40)
    out = greedy_speculative(runner, OracleMix(drafter, expected), PROMPT, 20, k, stats)
    assert out == expected[:20]
    assert 0 < stats.accepted < stats.drafted  # accepted and rejected drafts on the way
    context = PROMPT + out
    draft = drafter.propose(context, k)
    assert len(draft.tokens) == k and draft.probs.shape == (k, TINY.vocab_size)
    layers = drafter.hidden_layers
    start = len(PROMPT)  # the drafter's first row: the first generated token
    tokens = torch.tensor([context + draft.tokens])  # [1, T]
    hidden = target_hidden(loaded, context[:-1], layers)  # rows up to len(context) - 2
    hidden = {i: torch.nn.functional.pad(h, (0, 0, 0, tokens.shape[1] - h.shape[0]))[None] for i, h in hidden.items()}
    with torch.no_grad():
        if kind == "mtp":
            outs = mtp.train_forward(module, loaded.model, tokens, hidden[-1], torch.tensor([start]), k)
            rows = torch.stack([o[0, len(context) - 2] for o in outs])  # [k, H]
        else:
            anchors = torch.tensor([[len(context) - 1]])
            rows = dflash.train_forward(module, loaded.model, tokens, hidden, torch.tensor([start]), anchors)[0, 0, :k]
        reference = torch.softmax(shared_logits(loaded.model, rows), dim=-1)  # [k, V]
    torch.testing.assert_close(draft.probs, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_greedy_loop_equals_plain_decoding_and_greedy_drafts_have_no_probabilities(kind, one_thread):
    loaded = tiny_loaded()
    module = random_module(kind)
    drafter = (mtp.MTPDrafter if kind == "mtp" else dflash.DFlashDrafter)(module, loaded, max_seq_len=64)
    drafter.begin(PROMPT)
    assert drafter.propose(PROMPT + [1], 3).tokens == []  # nothing verified yet: nothing to draft from
    out = greedy_speculative(ModelRunner(loaded, max_seq_len=64), drafter, PROMPT, 10, 3)
    assert out == plain_greedy(loaded, PROMPT, 10)
    draft = drafter.propose(PROMPT + out, 2)
    assert len(draft.tokens) == 2 and draft.probs is None


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_file_round_trip_and_refusals(kind, tmp_path, one_thread):
    loaded = tiny_loaded()
    module = random_module(kind, block_size=4)
    path = save_drafter(tmp_path, module.cfg, TargetIdentity.of(loaded), module.state_dict(), step=7)
    load = mtp.load_mtp_drafter if kind == "mtp" else dflash.load_dflash_drafter
    drafter = load(tmp_path, loaded)
    for name, tensor in module.state_dict().items():
        assert torch.equal(drafter.module.state_dict()[name], tensor), name
    other = tiny_loaded(dataclasses.replace(TINY, num_layers=3))
    with pytest.raises(BonsaiError, match="trained for another model.*num_layers 2") as err:
        load(path, other)
    assert "\n" not in str(err.value)
    wrong = mtp.load_mtp_drafter if kind == "dflash" else dflash.load_dflash_drafter
    with pytest.raises(BonsaiError, match=f"is a '{kind}' drafter"):
        wrong(path, loaded)
    with pytest.raises(BonsaiError, match="drafter file not found"):
        load(tmp_path / "missing", loaded)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(BonsaiError, match="not a readable safetensors"):
        load(tmp_path / "junk.safetensors", loaded)


@pytest.mark.parametrize("kind", ["mtp", "dflash"])
def test_sampled_drafts_after_set_sampling_and_the_spec_parser_refusals(kind, tmp_path, one_thread):
    from engine.speculative.config import SpeculativeConfig, build_drafter
    loaded = tiny_loaded()
    module = random_module(kind, block_size=4)
    save_drafter(tmp_path, module.cfg, TargetIdentity.of(loaded), module.state_dict())
    drafter = build_drafter(SpeculativeConfig.from_spec(f"{kind}:{tmp_path}", num_draft_tokens=4, adaptive=False),
                            loaded, 64)
    runner = ModelRunner(loaded, max_seq_len=64)
    out = greedy_speculative(runner, drafter, PROMPT, 6, 4)
    drafter.set_sampling(SamplingParams(temperature=0.7, top_k=20, seed=3))
    first = drafter.propose(PROMPT + out, 4)
    drafter.set_sampling(SamplingParams(temperature=0.7, top_k=20, seed=3))
    assert drafter.propose(PROMPT + out, 4).tokens == first.tokens  # seeded: reproducible
    assert first.probs.shape == (4, TINY.vocab_size) and ((first.probs > 0).sum(-1) <= 20).all()
    drafter.set_sampling(SamplingParams())
    assert drafter.propose(PROMPT + out, 4).probs is None
    if kind == "dflash":
        with pytest.raises(BonsaiError, match="block size 4"):
            build_drafter(SpeculativeConfig.from_spec(f"dflash:{tmp_path}", num_draft_tokens=5), loaded, 64)
    other = tiny_loaded(dataclasses.replace(TINY, num_layers=3))
    with pytest.raises(BonsaiError, match="trained for another model"):
        build_drafter(SpeculativeConfig.from_spec(f"{kind}:{tmp_path}"), other, 64)


def test_dflash_refuses_a_draft_longer_than_its_block(tmp_path, one_thread):
    loaded = tiny_loaded()
    module = random_module("dflash", block_size=4)
    save_drafter(tmp_path, module.cfg, TargetIdentity.of(loaded), module.state_dict())
    with pytest.raises(BonsaiError, match="draft length 5 is larger than this DFlash drafter's block size 4"):
        dflash.load_dflash_drafter(tmp_path, loaded, k=5)
    drafter = dflash.load_dflash_drafter(tmp_path, loaded, k=4)
    assert drafter.max_draft_tokens == 4
    drafter.begin(PROMPT)
    with pytest.raises(BonsaiError, match="block size 4"):
        drafter.propose(PROMPT + [1], 6)
