"""Drafters and their bookkeeping without a model: n-gram lookup and pool, the length planner,
the mix's choices, statistics, and the config / spec strings."""
from __future__ import annotations

import pytest

from engine.errors import BonsaiError
from engine.speculative.config import DrafterSpec, SpeculativeConfig, build_drafter, parse_spec
from engine.speculative.drafter import Draft, Feedback
from engine.speculative.mix import MixDrafter
from engine.speculative.ngram import NgramDrafter, NgramPool
from engine.speculative.planner import Acceptance, DraftCost, TargetCost, best_length, shadow_matches
from engine.speculative.stats import SpecStats


def test_ngram_copies_what_followed_the_longest_match():
    d = NgramDrafter(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    context = [7, 1, 2, 3, 9, 9, 1, 2, 3, 5, 1, 2]
    # the last 3 tokens [5, 1, 2] never occurred; [1, 2] did, last at 6..7, followed by 3, 5, 1
    assert d.propose(context, 3).tokens == [3, 5, 1]
    assert d.propose(context + [3], 2).tokens == [5, 1]  # [2, 3] → most recent: 7..8 → 5
    assert d.propose([4, 4, 4], 0).tokens == []
    assert NgramDrafter(2, 3).propose([1, 2, 3, 4], 3).tokens == []  # no 2-gram repeats


def test_ngram_continues_a_periodic_match_past_the_end():
    d = NgramDrafter(1, 2)
    assert d.propose([8, 1, 2, 1, 2], 5).tokens == [1, 2, 1, 2, 1]
    assert d.propose([5, 5], 4).tokens == [5, 5, 5, 5]


def test_ngram_indexes_a_growing_context_once_and_restarts_on_another():
    d = NgramDrafter(1, 2)
    ctx = [1, 2, 3]
    assert d.propose(ctx, 2).tokens == []
    ctx += [1, 2]
    assert d.propose(ctx, 2).tokens == [3, 1]
    assert d.propose([9, 8, 9], 1).tokens == [8]  # a different context: indexed from scratch
    assert d.propose_after([4, 6, 4, 7], [4], 2).tokens == [7, 4]  # continue context + extra


def test_pool_remembers_across_requests_within_its_bound():
    pool = NgramPool(max_entries=6)
    first = NgramDrafter(2, 2, pool)
    first.propose([10, 11, 12, 13], 1)  # indexes (10,11)→12, (11,12)→13
    second = NgramDrafter(2, 2, pool)
    second.begin([5])
    assert second.propose([5, 10, 11], 3).tokens == [12, 13]  # from the pool, chained
    NgramDrafter(2, 2, pool).propose(list(range(20, 30)), 1)
    assert len(pool) == 6  # the oldest entries made room
    assert NgramDrafter(2, 2, pool).propose([10, 11], 1).tokens == []
    with pytest.raises(BonsaiError):
        NgramPool(0)


def test_planner_drafts_longer_when_acceptance_is_high_and_not_at_all_when_it_does_not_pay():
    gpu = TargetCost()
    gpu.observe(1, 0.010)
    gpu.observe(5, 0.011)  # wide passes cost almost nothing more
    free = DraftCost()
    assert best_length(0.9, 8, gpu, free) == 8
    assert 1 <= best_length(0.3, 8, gpu, free) < best_length(0.7, 8, gpu, free)
    cpu = TargetCost()
    cpu.observe(1, 0.054)
    cpu.observe(3, 0.114)  # each row costs ~0.55 of a pass
    assert best_length(0.4, 8, cpu, free) == 0  # plain decoding is faster
    assert best_length(0.95, 8, cpu, free) >= 2
    costly = DraftCost()
    costly.observe(4, 0.040)  # 10 ms per drafted token on top of a 10 ms pass
    assert best_length(0.6, 8, gpu, costly) == 0
    acc = Acceptance()
    for _ in range(30):
        acc.update(4, False)
    assert acc.rate > 0.9
    for _ in range(30):
        acc.update(0, True)
    assert acc.rate < 0.2
    assert shadow_matches([1, 2, 3], [1, 2, 9]) == (2, True)
    assert shadow_matches([1, 2, 3], [1, 2]) == (2, False)  # not judged past what was produced


class FixedDrafter:
    """Proposes a given continuation; counts how often it is asked."""
    hidden_layers = ()

    def __init__(self, name, tokens, draftless):
        self.name, self.tokens, self.draftless = name, tokens, draftless
        self.calls = 0
        self.observed = []

    def begin(self, prompt):
        pass

    def propose(self, context, k):
        self.calls += 1
        return Draft(self.tokens[:k], source=self.name)

    def observe(self, feedback):
        self.observed.append(feedback.accepted)


def _step(mix, k, accept):
    draft = mix.propose([1, 2, 3], k)
    accepted = min(accept, len(draft.tokens))
    mix.observe(Feedback(draft, accepted, 99, verify_seconds=0.01 + 0.001 * len(draft.tokens)))
    return draft


def test_mix_prefers_the_member_that_is_being_accepted():
    good = FixedDrafter("good", [5, 6, 7, 8], draftless=True)
    bad = FixedDrafter("bad", [1, 1, 1, 1], draftless=True)
    mix = MixDrafter([bad, good])
    for _ in range(20):
        draft = mix.propose([1, 2, 3], 4)
        produced_ok = draft.sources and draft.sources[0] == "good"
        mix.observe(Feedback(draft, len(draft.tokens) if produced_ok else 0,
                             5 if not produced_ok else 9, verify_seconds=0.01))
    assert draft.source == "good" and len(draft.tokens) == 4
    assert bad.calls == 20  # draftless members propose every step and are judged in the shadow
    assert mix.members[0].acceptance.rate < 0.2 < 0.8 < mix.members[1].acceptance.rate


def test_mix_stops_asking_a_model_member_that_is_rejected_and_extends_with_ngram():
    model = FixedDrafter("draft", [4, 5], draftless=False)
    mix = MixDrafter([NgramDrafter(1, 2), model])
    context = [4, 5, 6, 4, 5]  # the n-gram continuation of ... 4, 5 is 6, 4, 5
    for _ in range(12):
        draft = mix.propose(context, 4)
        mix.observe(Feedback(draft, 0, 77, verify_seconds=0.01 * (1 + len(draft.tokens))))
    asked = model.calls
    for _ in range(8):
        mix.propose([1, 2, 3], 4)  # no n-gram match, and the model member is not worth asking
        mix.observe(Feedback(Draft([]), 0, 77, verify_seconds=0.01))
    assert model.calls - asked <= 1  # at most a probe
    assert len(model.observed) == 20  # every member observes every step
    fresh = MixDrafter([NgramDrafter(1, 2), FixedDrafter("draft", [6], draftless=False)])
    assert fresh.propose([6, 4, 5, 3, 1, 2], 4).tokens == []  # first a plain step, to time one row
    fresh.observe(Feedback(Draft([]), 0, 2, verify_seconds=0.010))
    fresh.target.observe(5, 0.0104)  # and wide passes cost little (a GPU)
    draft = fresh.propose([6, 4, 5, 3, 1, 2], 4)  # model drafts [6]; n-gram continues 6 → 4, 5, ...
    assert draft.tokens[:3] == [6, 4, 5] and draft.sources[:3] == ["draft", "ngram", "ngram"]


def test_a_draft_models_catch_up_on_plain_steps_is_not_counted_as_drafting_cost(monkeypatch):
    """A model member that drafts after plain steps first feeds them (seconds apart from drafting):
    counted, one probe would price its tokens at those steps' cost and the planner never ask again."""
    import engine.speculative.mix as mix_module
    clock = [0.0]
    monkeypatch.setattr(mix_module.time, "perf_counter", lambda: clock[0])

    class CatchingUp(FixedDrafter):
        def propose(self, context, k):
            self.catch_up_seconds = 10.0  # a long gap fed first
            clock[0] += 10.0 + 0.5 * min(k, len(self.tokens))
            return super().propose(context, k)

    mix = MixDrafter([CatchingUp("draft", [4, 5, 6], draftless=False)])
    mix.target.observe(1, 1.0)
    mix.target.observe(4, 1.1)  # wide passes cost little
    draft = mix.propose([1, 2, 3], 3)
    assert draft.tokens
    assert mix.members[0].cost.per_token == pytest.approx(0.5)


def test_stats_count_per_position_and_per_drafter():
    s = SpecStats("mix")
    s.record(["ngram"] * 3, 2)
    s.record(["draft", "ngram"], 0)
    s.record([], 0)  # a plain step
    assert (s.steps, s.drafted, s.accepted) == (3, 5, 2)
    assert s.drafted_per_position == [2, 2, 1] and s.accepted_per_position == [1, 1, 0]
    assert s.by_drafter["ngram"].drafted == 4 and s.by_drafter["ngram"].accepted == 2
    assert s.by_drafter["draft"].proposals == 1
    assert s.mean_accepted_length == pytest.approx(1 + 2 / 3)
    total = SpecStats.from_dict(s.as_dict())
    total.merge(s)
    assert total.accepted == 4 and total.accepted_per_position == [2, 2, 0]


def test_spec_strings_parse_into_the_config():
    assert parse_spec("ngram") == (DrafterSpec("ngram"),)
    assert parse_spec("mix:ngram, draft:/m/x.gguf") == (DrafterSpec("ngram"), DrafterSpec("draft", "/m/x.gguf"))
    assert parse_spec("mtp") == (DrafterSpec("mtp"),) and parse_spec("dflash:d") == (DrafterSpec("dflash", "d"),)
    cfg = SpeculativeConfig.from_spec("mix:ngram,mtp", num_draft_tokens=6)
    assert cfg.method == "mix:ngram,mtp" and cfg.num_draft_tokens == 6
    assert SpeculativeConfig.from_dict({"method": "ngram", "ngram_max": 3}).ngram_max == 3


@pytest.mark.parametrize("bad, message", [
    ("ngarm", "did you mean ngram"), ("draft", "draft:PATH"), ("mix", "list of drafters"),
    ("mix:ngram,ngram", "twice"), ("mix:ngram,mix:draft:x", "cannot contain"), ("", "empty"),
    ("ngram:x", "takes no path")])
def test_bad_spec_strings_say_what_to_write(bad, message):
    with pytest.raises(BonsaiError, match=message):
        SpeculativeConfig.from_spec(bad)


def test_bad_config_values_and_keys():
    with pytest.raises(BonsaiError, match="1..64"):
        SpeculativeConfig.from_spec("ngram", num_draft_tokens=0)
    with pytest.raises(BonsaiError, match="min <= max"):
        SpeculativeConfig.from_spec("ngram", ngram_min=3, ngram_max=2)
    with pytest.raises(BonsaiError, match="did you mean 'num_draft_tokens'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_draft_token": 4})


def test_factory_refuses_missing_drafter_files_and_k_above_a_block_size(tmp_path, monkeypatch):
    cfg = SpeculativeConfig.from_spec("mtp:" + str(tmp_path / "missing.safetensors"))
    with pytest.raises(BonsaiError, match="not found"):
        build_drafter(cfg, target=None, max_seq_len=64)
    with pytest.raises(BonsaiError, match="needs its file"):
        build_drafter(SpeculativeConfig.from_spec("dflash"), target=None, max_seq_len=64)
    with pytest.raises(BonsaiError, match="draft model"):
        build_drafter(SpeculativeConfig.from_spec("draft:" + str(tmp_path / "nope.gguf")), target=None, max_seq_len=64)

    class BlockDrafter(FixedDrafter):
        max_draft_tokens = 8

    import sys
    import types
    module = types.ModuleType("engine.speculative.dflash")
    seen = {}

    def load_dflash_drafter(path, target, *, k, max_seq_len, module=None):
        seen.update(path=path, k=k, max_seq_len=max_seq_len, module=module)
        drafter = BlockDrafter("dflash", [1] * 8, False)
        drafter.module = object()
        return drafter

    module.load_dflash_drafter = load_dflash_drafter
    monkeypatch.setitem(sys.modules, "engine.speculative.dflash", module)
    drafter_file = tmp_path / "d.safetensors"
    drafter_file.write_bytes(b"")
    cfg = SpeculativeConfig.from_spec(f"dflash:{drafter_file}", num_draft_tokens=8, adaptive=False)
    assert build_drafter(cfg, None, 64).max_draft_tokens == 8
    assert seen == {"path": str(drafter_file), "k": 8, "max_seq_len": 64 + 9, "module": None}
    with pytest.raises(BonsaiError, match="block size"):
        build_drafter(SpeculativeConfig.from_spec(f"dflash:{drafter_file}", num_draft_tokens=12), None, 64)


def test_a_draft_model_is_a_path_or_a_pulled_name(tmp_path, monkeypatch):
    """draft:NAME resolves through the store (the built-in qwen2.5-coder-0.5b once pulled); an unpulled
    name says how to pull it, for the loader and for the memory plan alike."""
    from engine.sources import store
    from engine.memory.budget import draft_model_plan
    from engine.speculative.draft_model import resolve_draft_model
    monkeypatch.setenv("BONSAI_HOME", str(tmp_path / "home"))
    with pytest.raises(BonsaiError, match=r"draft model: model 'qwen2.5-coder-0.5b' is not in the store .*"
                                          r"bonsai pull qwen2.5-coder-0.5b"):
        build_drafter(SpeculativeConfig.from_spec("draft:qwen2.5-coder-0.5b"), target=None, max_seq_len=64)
    with pytest.raises(BonsaiError, match="draft model: model 'qwen2.5-coder-0.5b' is not in the store"):
        draft_model_plan("qwen2.5-coder-0.5b", None, 4)
    stored = store.builtin_model_path("qwen2.5-coder-0.5b")
    stored.parent.mkdir(parents=True)
    stored.write_bytes(b"GGUF")
    assert resolve_draft_model("qwen2.5-coder-0.5b") == stored
    assert resolve_draft_model(str(stored)) == stored


def test_joint_draft_lengths_weigh_the_whole_pass():
    from engine.speculative.planner import TargetCost, joint_draft_lengths
    flat = TargetCost({1: 1.0, 16: 1.0})  # rows are free: keep every draft
    assert joint_draft_lengths([0.9, 0.2], [4, 4], flat) == [4, 4]
    steep = TargetCost({1: 1.0, 2: 2.0})  # a row costs a whole pass: no draft pays
    assert joint_draft_lengths([0.99, 0.99], [4, 4], steep) == [0, 0]
    # 8 slots, a row costs 20% of a one-row pass: only the drafts likely to be kept
    mid = TargetCost({1: 1.0, 2: 1.2})
    keep = joint_draft_lengths([0.95] * 4 + [0.1] * 4, [4] * 8, mid)
    assert keep[4:] == [0] * 4 and all(k > 0 for k in keep[:4])
    assert joint_draft_lengths([0.5], [0], mid) == [0]


def test_row_counts_not_measured_are_estimated_from_their_neighbours():
    """Interpolated between the nearest measured row counts, extended from the largest by the slope of the last two:
    on the GPU the second row costs more than the next ones (another kernel), and a line through the one-row pass
    priced 6-9 rows at ~1.5x what they cost, so 4 slots kept about one draft a step and never measured wider passes."""
    from engine.speculative.planner import TargetCost, joint_draft_lengths
    gpu = TargetCost({1: 1.74, 2: 2.05, 3: 2.49, 4: 2.50, 5: 2.53})  # ms by rows, H100, the 8B ternary fused step
    assert gpu.estimate(8) == pytest.approx(2.53 + 3 * 0.03)
    assert TargetCost({1: 1.0, 4: 1.3}).estimate(2) == pytest.approx(1.1)
    assert TargetCost({4: 2.0}).estimate(2) < 2.0 and TargetCost().estimate(5) == pytest.approx(1.2)
    assert sum(joint_draft_lengths([0.9] * 4, [4] * 4, gpu)) >= 8  # (the line through one: 1 draft in all)
