"""A Qwen3.5 checkpoint's own MTP head as a drafter (`--spec mtp`): its drafts' distributions equal a
reference head made of transformers' own layers (vLLM's layout), greedy output with it (alone and mixed
with n-gram) equals plain decoding, the GGUF converter's MTP blocks give the same head, the slots share
its weights, the memory plan counts it, and a model without one is refused in one line."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5")

from engine.decoding.sampling import SamplingParams  # noqa: E402
from engine.errors import BonsaiError  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.sources.gguf_file import GGUFFile  # noqa: E402
from engine.sources.hf_files import HFModelDir  # noqa: E402
from engine.sources.mtp_source import mtp_layer_count, read_mtp_tensors  # noqa: E402
from engine.speculative.config import SpeculativeConfig, build_drafter, build_drafters  # noqa: E402
from engine.speculative.drafter import Draft  # noqa: E402
from engine.speculative.native_mtp import native_mtp_numel  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from tests.engine_runs import run_engine  # noqa: E402
from tests.hybrid_gguf import write_qwen35_gguf  # noqa: E402
from tests.hybrid_tiny import add_mtp_head, make_hybrid_model, reference_mtp_logits  # noqa: E402

PROMPT = [3, 17, 42, 9, 3, 17, 42, 9, 3, 17, 42, 9, 5]
VOCAB = 64


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, smollm2_gguf):
    import transformers
    out = tmp_path_factory.mktemp("tok")
    transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def with_head(tmp_path_factory, tok_dir):
    """(directory, HF model, reference head) of a tiny hybrid whose files carry an MTP head."""
    path = tmp_path_factory.mktemp("qwen35-mtp")
    model = make_hybrid_model(path, tok_dir, vocab_size=VOCAB)
    with torch.no_grad():  # a peaked head: greedy loops, so n-gram drafts are accepted and rejected
        model.lm_head.weight.mul_(20)
    model.save_pretrained(path)
    head = add_mtp_head(path, model)
    return path, model, head


@pytest.fixture(scope="module")
def loaded(with_head):
    return load_model(with_head[0], dtype=torch.float32, weight_dtype=torch.float32)


def plain(loaded, n):
    return run_engine(ModelRunner(loaded, 96), None, PROMPT, max_tokens=n, ignore_eos=True, text=False)[1]


class Oracle:
    """Proposes the known continuation right for a varying number of tokens, then wrong, while the MTP
    drafter drafts too and sees every verification (as inside a mix): accepted and rejected rows."""

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
            tokens.append((self.continuation[done + len(tokens)] + 1) % VOCAB)
        return Draft(tokens[:k], None, self.name)

    def observe(self, feedback):
        self.inner.observe(feedback)


def test_drafts_follow_the_reference_head(with_head, loaded, one_thread):
    _, model, head = with_head
    drafter = build_drafter(SpeculativeConfig.from_spec("mtp", num_draft_tokens=3, adaptive=False), loaded, 96)
    assert type(drafter).__name__ == "MTPDrafter" and drafter.module.cfg.num_layers == 1
    expected = plain(loaded, 30)
    out = run_engine(ModelRunner(loaded, 96), None, PROMPT, drafter=Oracle(drafter, expected), k=3,
                     max_tokens=16, ignore_eos=True, text=False)[1]
    assert out == expected[:16]
    context = PROMPT + out
    drafter.set_sampling(SamplingParams(temperature=1.0, seed=5))
    draft = drafter.propose(context, 3)
    start = len(context) - 1 - drafter.length  # its rows: one per verified position from the first generated token
    assert start == len(PROMPT)
    assert len(draft.tokens) == 3 and draft.probs.shape == (3, VOCAB)
    reference = torch.softmax(reference_mtp_logits(model, head, context, start, draft.tokens[:2]), dim=-1)  # [3, V]
    torch.testing.assert_close(draft.probs, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("spec", ["mtp", "mix:ngram,mtp"])
def test_greedy_output_equals_plain_decoding(spec, loaded, one_thread):
    drafter = build_drafter(SpeculativeConfig.from_spec(spec, num_draft_tokens=3), loaded, 96)
    _, ids, _, stats = run_engine(ModelRunner(loaded, 96), None, PROMPT, drafter=drafter, k=3, max_tokens=30,
                                  ignore_eos=True, text=False)
    assert ids == plain(loaded, 30) and stats.speculative.drafted > 0


def test_the_slots_share_one_head(loaded):
    drafters = build_drafters(SpeculativeConfig.from_spec("mtp", adaptive=False), loaded, 96, count=3)
    assert len({id(d.module) for d in drafters}) == 1 and len({id(d.k) for d in drafters}) == 3


def test_the_gguf_converters_mtp_blocks_give_the_same_head(tmp_path, tok_dir, smollm2_gguf, capsys, one_thread):
    hf_path = tmp_path / "hf"
    add_mtp_head(hf_path, make_hybrid_model(hf_path, tok_dir))  # the tokenizer's whole vocabulary: a GGUF needs it
    path = write_qwen35_gguf(hf_path, tmp_path / "mtp.gguf", smollm2_gguf)
    gguf, hf = GGUFFile(path), HFModelDir(hf_path)
    assert gguf.metadata["qwen35.block_count"] == 5 and gguf.model_config().num_layers == 4
    assert mtp_layer_count(gguf, 4) == mtp_layer_count(hf, 4) == 1
    ours, theirs = read_mtp_tensors(gguf, gguf.model_config()), read_mtp_tensors(hf, hf.model_config())
    assert sorted(ours) == sorted(theirs) and len(ours) == 15
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, atol=1e-6, rtol=0, msg=name)
    outputs = []
    for source in (hf_path, path):
        target = load_model(source, dtype=torch.float32, weight_dtype=torch.float32)
        drafter = build_drafter(SpeculativeConfig.from_spec("mtp", num_draft_tokens=3, adaptive=False), target, 96)
        outputs.append(run_engine(ModelRunner(target, 96), None, PROMPT, drafter=drafter, k=3, max_tokens=12,
                                  ignore_eos=True, text=False)[1])
        drafter.set_sampling(SamplingParams(temperature=1.0, seed=2))
        outputs.append(drafter.propose(PROMPT + outputs[-1], 3).probs)
    assert outputs[0] == outputs[2] == plain(load_model(hf_path, dtype=torch.float32, weight_dtype=torch.float32), 12)
    torch.testing.assert_close(outputs[1], outputs[3], atol=1e-5, rtol=1e-4)
    from tests.test_cli_errors import bonsai_in_process
    for source, layers in ((path, 1), (hf_path, 1)):
        proc = bonsai_in_process(capsys, "info", str(source), "--json")
        assert proc.returncode == 0 and json.loads(proc.stdout)["architecture"]["hybrid"]["mtp_layers"] == layers
    proc = bonsai_in_process(capsys, "info", str(path))
    assert "MTP head" in proc.stdout and "--spec mtp" in proc.stdout


def test_the_memory_plan_counts_the_head(loaded):
    from engine.memory.budget import drafter_plan, run_settings
    cfg = loaded.config
    settings = run_settings(cfg, "cpu", 96, slots=2)
    plan = drafter_plan(SpeculativeConfig.from_spec("mix:ngram,mtp", num_draft_tokens=3), settings, cfg)
    drafter = build_drafter(SpeculativeConfig.from_spec("mtp", adaptive=False), loaded, 96)
    weights = sum(p.numel() for p in drafter.module.parameters())
    assert native_mtp_numel(cfg) == weights
    lines = {line.name: line.bytes for line in plan.lines}
    assert lines["mtp head (the model's own)"] == weights * 4
    assert lines["mtp head KV cache (2 x 100 positions)"] == 2 * 2 * cfg.num_kv_heads * 100 * cfg.head_dim * 4


def test_models_without_a_head_are_refused_in_one_line(with_head, tmp_path, tok_dir):
    bare = tmp_path / "bare"
    make_hybrid_model(bare, tok_dir, vocab_size=VOCAB)
    target = load_model(bare, dtype=torch.float32, weight_dtype=torch.float32)
    with pytest.raises(BonsaiError, match="has no MTP head.*--spec ngram") as e:
        build_drafter(SpeculativeConfig.from_spec("mtp"), target, 96)
    assert "\n" not in str(e.value)
    from tests.test_drafters import tiny_loaded
    with pytest.raises(BonsaiError, match="models have none: train one.*mtp:DIR"):
        build_drafter(SpeculativeConfig.from_spec("mtp"), tiny_loaded(), 96)
    from safetensors.torch import load_file, save_file
    (bare / "model-mtp.safetensors").write_bytes((with_head[0] / "model-mtp.safetensors").read_bytes())
    tensors = load_file(str(bare / "model-mtp.safetensors"))
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :10].contiguous()
    save_file(tensors, str(bare / "model-mtp.safetensors"))
    with pytest.raises(BonsaiError, match=r"mtp.fc.weight has shape \(64, 10\).*does not belong"):
        build_drafter(SpeculativeConfig.from_spec("mtp"), target, 96)
    del tensors["mtp.layers.0.mlp.down_proj.weight"]
    tensors["mtp.fc.weight"] = load_file(str(with_head[0] / "model-mtp.safetensors"))["mtp.fc.weight"]
    save_file(tensors, str(bare / "model-mtp.safetensors"))
    with pytest.raises(BonsaiError, match="lacks 1 tensor.*mtp.layers.0.down_proj.weight"):
        build_drafter(SpeculativeConfig.from_spec("mtp"), target, 96)
    assert json.loads((bare / "config.json").read_text()).get("mtp_num_hidden_layers") is None


def test_quantize_copies_the_head_and_the_checkpoint_drafts_with_it(with_head, tmp_path, one_thread):
    from engine.quantization.quantize import QuantizeOptions, quantize
    from engine.sources.checkpoint_file import BonsaiCheckpoint
    from quant.formats import QuantSpec
    from quant.recipe import Recipe
    out = tmp_path / "q"
    report = quantize(with_head[0], out, QuantizeOptions(Recipe(QuantSpec("int4", 32)), evaluate=False))
    assert len(report.mtp_head) == 15 and all(t.format == "bf16" for t in report.mtp_head)
    assert not any(t.name.startswith("mtp.") for t in report.tensors)  # the model's totals leave the head out
    source, hf = BonsaiCheckpoint(out), HFModelDir(with_head[0])
    copied, original = read_mtp_tensors(source, source.model_config()), read_mtp_tensors(hf, hf.model_config())
    assert sorted(copied) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(copied[name], tensor.bfloat16().float()), name
    target = load_model(out, dtype=torch.float32, weight_dtype=torch.float32)
    drafter = build_drafter(SpeculativeConfig.from_spec("mtp", num_draft_tokens=3), target, 96)
    ids = run_engine(ModelRunner(target, 96), None, PROMPT, drafter=drafter, k=3, max_tokens=20,
                     ignore_eos=True, text=False)[1]
    assert ids == plain(target, 20)


def test_a_dummy_target_drafts_with_a_generated_head(loaded, one_thread):
    """`--load-format dummy` (the H200 speed runs): the head's weights are generated like the model's."""
    from engine.weights.loader import load_dummy
    target = load_dummy(loaded.config, "tiny-dummy", dtype=torch.float32)
    drafter = build_drafter(SpeculativeConfig.from_spec("mtp", num_draft_tokens=3, adaptive=False), target, 96)
    _, ids, _, stats = run_engine(ModelRunner(target, 96), None, PROMPT, drafter=drafter, k=3, max_tokens=12,
                                  ignore_eos=True, text=False)
    assert ids == plain(target, 12) and stats.speculative.drafted > 0


def test_the_fused_step_hands_drafters_the_hidden_state_a_model_pass_gives(loaded, one_thread):
    """Where a decode step runs fused (CUDA-graphed on a GPU), a verify that must return the last hidden
    state stays on it (one row on a hybrid; any rows on a dense model): its rows' logits are plain
    decoding's, and the hidden state is the eager pass's."""
    from tests.test_drafters import tiny_loaded
    for target, widths in ((loaded, (1,)), (tiny_loaded(), (1, 3))):
        for t in widths:
            fused, eager = ModelRunner(target, 96, fast_decode=True), ModelRunner(target, 96)
            assert fused.decoder is not None and eager.decoder is None
            tokens = PROMPT[-t:]
            for r in (fused, eager):
                r.prefill(r.slot(0), PROMPT[:-t])
            logits, hidden = fused.verify(fused.slot(0), tokens, (-1,))
            ref_logits, ref_hidden = eager.verify(eager.slot(0), tokens, (-1,))
            assert hidden[-1].shape == ref_hidden[-1].shape == (t, target.config.hidden_size)
            torch.testing.assert_close(hidden[-1], ref_hidden[-1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", ["mtp", "mix:ngram,mtp"])
def test_greedy_output_with_the_fused_decoder_equals_plain_decoding(spec, loaded, one_thread):
    drafter = build_drafter(SpeculativeConfig.from_spec(spec, num_draft_tokens=3, adaptive=False), loaded, 96)
    _, ids, _, stats = run_engine(ModelRunner(loaded, 96, fast_decode=True), None, PROMPT, drafter=drafter, k=3,
                                  max_tokens=24, ignore_eos=True, text=False)
    assert ids == plain(loaded, 24) and stats.speculative.drafted > 0


class Twin:
    """Two drafters fed the same verifications; proposes the first's drafts after checking the second's agree."""

    def __init__(self, a, b):
        self.a, self.b, self.name, self.hidden_layers, self.compared = a, b, "twin", a.hidden_layers, 0

    def begin(self, prompt):
        self.a.begin(prompt)
        self.b.begin(prompt)

    def propose(self, context, k):
        da, db = self.a.propose(context, k), self.b.propose(context, k)
        assert da.tokens == db.tokens, (len(context), da.tokens, db.tokens)
        self.compared += len(da.tokens)
        return da

    def observe(self, feedback):
        self.a.observe(feedback)
        self.b.observe(feedback)


@pytest.mark.parametrize("native", [True, False], ids=["native", "trained"])
def test_static_proposals_equal_the_dynamic_path(native, loaded, one_thread):
    """engine.speculative.mtp_graph (fixed shapes, what a GPU replays as CUDA graphs) drafts what MTPDrafter's own
    path drafts, for the native head and for a trained MTP drafter on a dense model."""
    from engine.speculative.mtp import MTPDrafter
    from engine.speculative.native_mtp import load_native_mtp_module
    from tests.test_drafters import random_module, tiny_loaded
    target = loaded if native else tiny_loaded()
    module = load_native_mtp_module(loaded) if native else random_module("mtp", num_layers=2)
    twin = Twin(MTPDrafter(module, target, 96, static=True), MTPDrafter(module, target, 96, static=False))
    assert twin.a.static is not None and twin.b.static is None
    twin.a.prepare(3)  # what a GPU captures before any request (here: runs once, eagerly)
    assert twin.a.static_rows == 4 and twin.a.length == 0 and twin.a.last is None
    prompt = PROMPT if native else [5, 17, 3, 42, 8, 11, 60, 2]
    ids = run_engine(ModelRunner(target, 96), None, prompt, drafter=twin, k=3, max_tokens=24, ignore_eos=True,
                     text=False)[1]
    want = run_engine(ModelRunner(target, 96), None, prompt, max_tokens=24, ignore_eos=True, text=False)[1]
    assert ids == want and twin.compared > 20


def test_the_head_takes_in_the_prompt_before_its_first_draft(with_head, loaded, one_thread):
    """spec_step asks the runner to keep the prompt chunks' hidden states (engine.runtime.runner.record_prompt_rows):
    the head's cache holds every position from 0, as vLLM runs it, and its drafts follow the reference over all."""
    _, model, head = with_head
    drafter = build_drafter(SpeculativeConfig.from_spec("mtp", num_draft_tokens=3, adaptive=False), loaded, 96)
    assert drafter.prompt_rows == 512
    runner = ModelRunner(loaded, 96, prefill_chunk_size=5)  # a prompt of 13 in three chunks
    out = run_engine(runner, None, PROMPT, drafter=drafter, k=3, max_tokens=10, ignore_eos=True, text=False)[1]
    assert out == plain(loaded, 10) and runner.take_prompt_rows(0) is None  # taken at the first proposal
    context = PROMPT + out
    drafter.set_sampling(SamplingParams(temperature=1.0, seed=5))
    draft = drafter.propose(context, 2)
    assert drafter.length == len(context) - 1  # rows 0 .. len(context) - 2
    reference = torch.softmax(reference_mtp_logits(model, head, context, 0, draft.tokens[:1]), dim=-1)  # [2, V]
    torch.testing.assert_close(draft.probs, reference, atol=2e-5, rtol=1e-4)
