"""The fused decode step of a hybrid (engine.runtime.hybrid_step inside engine.runtime.decode_step): the body a
CUDA graph captures. On the CPU: its logits against transformers (through the references, and through the
Triton kernels in the interpreter), verify rows of one slot through the recorded pass, and what the step does
that a graph could not hold (a host sync, an allocation that grows with the slot count). The `gpu` test runs
it graphed on CUDA against the CPU's eager path."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel module is first imported
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")
pytest.importorskip("triton")

from engine.runtime.decode_step import StepInputs, Workspace, decode_step, make_ops  # noqa: E402
from engine.runtime.kv_cache import KVCache  # noqa: E402
from engine.runtime.hybrid_state import attach_states  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from tests.hybrid_tiny import make_hybrid_model, reference_logits, tokenizer_dir  # noqa: E402

TOL = 1e-4
PROMPT = [(i * 37 + 11) % 49152 for i in range(30)]
OTHER = [(i * 53 + 5) % 49152 for i in range(20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_gguf):
    path = tmp_path_factory.mktemp("qwen35-step")
    return path, make_hybrid_model(path, tokenizer_dir(tmp_path_factory, smollm2_gguf))


@pytest.fixture(scope="module")
def hybrid(model_dir):
    path, model = model_dir
    return model, load_model(path, dtype=torch.float32, weight_dtype=torch.float32)


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "kernels"])
def test_fused_decode_matches_transformers(hybrid, kernels, monkeypatch):
    if kernels and torch.cuda.is_available():
        pytest.skip("with a GPU the kernels run compiled: test_graphed_hybrid_step_on_cuda_matches_the_cpu")
    if kernels:
        monkeypatch.setenv("BONSAI_KERNELS_ON_CPU", "1")
    model, loaded = hybrid
    runner = ModelRunner(loaded, max_seq_len=64, num_slots=3, prefill_chunk_size=8, fast_decode=True)
    assert runner.decoder is not None and runner.decoder.ops.fast == kernels
    assert runner.short_prefill_rows == 0 and runner.prefill_graphs is None
    a, b = runner.slot(2), runner.slot(0)
    runner.prefill(a, PROMPT[:20])
    runner.prefill(b, OTHER[:9])
    for i in range(3):  # two slots in one fused step, then one
        logits = runner.decode_batch([a, b], [PROMPT[20 + i], OTHER[9 + i]])  # [2, V]
        assert (logits[0] - reference_logits(model, PROMPT[:21 + i])[-1]).abs().max() <= TOL
        assert (logits[1] - reference_logits(model, OTHER[:10 + i])[-1]).abs().max() <= TOL
    logits = runner.forward(a, [PROMPT[23]])
    assert (logits[-1] - reference_logits(model, PROMPT[:24])[-1]).abs().max() <= TOL
    c = runner.slot(1)  # from position 0, the fused step ignores what the slot's state buffers hold
    runner.cache.states.recurrent[:, 1] = 7.0
    runner.cache.states.conv[:, 1] = 3.0
    for i, tok in enumerate(OTHER[:3]):
        logits = runner.forward(c, [tok])
        assert (logits[-1] - reference_logits(model, OTHER[:i + 1])[-1]).abs().max() <= TOL


@pytest.mark.parametrize("kernels", [False, True], ids=["references", "kernels"])
def test_verify_rows_of_one_slot_roll_back_through_the_fused_runner(hybrid, kernels, monkeypatch):
    """Rows of one slot step its DeltaNet state in order inside the fused step, each row's state kept
    (HybridStates.begin_row_runs): logits are the reference's, a rewind restores the accepted row's."""
    if kernels and torch.cuda.is_available():
        pytest.skip("with a GPU the kernels run compiled: test_graphed_hybrid_step_on_cuda_matches_the_cpu")
    if kernels:
        monkeypatch.setenv("BONSAI_KERNELS_ON_CPU", "1")
    model, loaded = hybrid
    runner = ModelRunner(loaded, max_seq_len=64, num_slots=2, prefill_chunk_size=8, fast_decode=True)
    assert runner.decoder.ops.fast == kernels
    slot, other = runner.slot(0), runner.slot(1)
    runner.prefill(slot, PROMPT[:16])
    runner.prefill(other, OTHER[:5])
    logits = runner.step_rows(PROMPT[16:19] + [1, 2] + OTHER[5:7], [16, 17, 18, 19, 20, 5, 6],
                              [0] * 5 + [1] * 2)  # two verify passes in one call (spec_step's batched verify)
    slot.tokens.extend(PROMPT[16:19] + [1, 2])
    other.tokens.extend(OTHER[5:7])
    assert (logits[:3] - reference_logits(model, PROMPT[:19])[16:]).abs().max() <= TOL
    assert (logits[5:] - reference_logits(model, OTHER[:7])[5:]).abs().max() <= TOL
    slot.rewind(2)  # the two wrong drafts
    out = runner.forward(slot, [PROMPT[19]])  # a fused step from the restored state
    assert (out[-1] - reference_logits(model, PROMPT[:20])[-1]).abs().max() <= TOL
    with pytest.raises(Exception, match="cannot go back"):  # the fused step dropped the rollback points
        slot.rewind(2)
    logits, hidden = runner.verify(slot, PROMPT[20:23], (-1,))  # one slot's verify, the last hidden state too
    assert (logits - reference_logits(model, PROMPT[:23])[20:]).abs().max() <= TOL and hidden[-1].shape[0] == 3
    slot.rewind(3)  # back to before the pass (its first rollback point: the state copied before it)
    out = runner.forward(slot, [PROMPT[20]])
    assert (out[-1] - reference_logits(model, PROMPT[:21])[-1]).abs().max() <= TOL


def _allocations_and_syncs(loaded, num_slots: int) -> tuple[list, set]:
    """The shapes of the tensors one two-row fused step allocates (outputs sharing no input's storage),
    and the host-sync ops it calls (through the references: the kernel launches allocate only their outputs)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.allocated, self.ops = [], set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.add(func.__name__)
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.allocated += [(func.__name__, tuple(t.shape)) for t in tree_leaves(out)
                               if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
            return out

    cfg = loaded.config
    cache = KVCache(cfg, 32, num_slots, dtype=torch.float32, device="cpu")
    attach_states(cache, cfg)
    inputs = StepInputs(tokens=torch.tensor([3, 4]), positions=torch.tensor([5, 0], dtype=torch.int32),
                        slot_ids=torch.tensor([num_slots - 1, 0], dtype=torch.int32),
                        seq_lens=torch.tensor([6, 1], dtype=torch.int32))
    ws = Workspace.make(loaded.model, 2, torch.device("cpu"))
    ops = make_ops(torch.device("cpu"), kernels=False)
    with torch.inference_mode(), Record() as record:
        decode_step(loaded.model, cache, inputs, ops, 1, ws)
    return record.allocated, record.ops


def test_the_step_allocates_nothing_per_slot_and_never_syncs(hybrid):
    _, loaded = hybrid
    small, ops = _allocations_and_syncs(loaded, 2)
    large, _ = _allocations_and_syncs(loaded, 5)
    assert small == large  # the states are updated where they live: no copy of every slot's buffers
    assert not ops & {"_local_scalar_dense", "nonzero", "masked_select", "item"}, ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_hybrid_step_on_cuda_matches_the_cpu(model_dir):
    path, _ = model_dir
    cpu = ModelRunner(load_model(path, dtype=torch.float32, weight_dtype=torch.float32), 64, 2, 8)
    gpu = ModelRunner(load_model(path, device="cuda", dtype=torch.float32, weight_dtype=torch.float32), 64, 2, 8)
    assert gpu.decoder is not None and gpu.decoder.graph is not None
    for runner in (cpu, gpu):
        runner.prefill(runner.slot(0), PROMPT[:12])
        runner.prefill(runner.slot(1), OTHER[:7])
    for i in range(4):
        want = cpu.decode_batch([cpu.slot(0), cpu.slot(1)], [PROMPT[12 + i], OTHER[7 + i]])
        got = gpu.decode_batch([gpu.slot(0), gpu.slot(1)], [PROMPT[12 + i], OTHER[7 + i]]).cpu()
        assert (got - want).abs().max() <= 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_hybrid_prefill_on_cuda_matches_the_cpu(model_dir):
    """Full prefill chunks replayed from CUDA graphs (the Triton chunked rule inside, the slot's state read and
    written by index): the logits of each chunk and of the decode after them are the CPU's."""
    path, _ = model_dir
    cpu = ModelRunner(load_model(path, dtype=torch.float32, weight_dtype=torch.float32), 64, 1, 8)
    gpu = ModelRunner(load_model(path, device="cuda", dtype=torch.float32, weight_dtype=torch.float32), 64, 1, 8)
    assert gpu.prefill_graphs is not None
    want = cpu.prefill(cpu.slot(0), PROMPT[:24])
    tol = 1e-3 * (1 + want.abs().max().item())  # tf32 dots in the rule
    for _ in range(3):  # captures, then replays (from position 0: the state starts from zeros)
        gpu.slot(0).reset()
        got = gpu.prefill(gpu.slot(0), PROMPT[:24]).cpu()
        assert (got - want).abs().max() <= tol
    assert not gpu.prefill_graphs.failed and len(gpu.prefill_graphs.graphs) == 3
    want, got = cpu.forward(cpu.slot(0), [PROMPT[24]]), gpu.forward(gpu.slot(0), [PROMPT[24]]).cpu()
    assert (got - want).abs().max() <= tol


def test_packed_hybrid_fused_step_tracks_the_eager_path():
    """Generated ternary blocks (int4 head): the fused step's int8-activation GEMVs, q/k/v and z sharing one
    quantization, against the model's eager path on the same packed weights (whose one-row products quantize
    their activations the same way)."""
    from engine.sources.hybrid_config import HybridConfig
    from engine.sources.model_config import ModelConfig
    from engine.weights.formats import WeightFormat
    from engine.weights.loader import load_dummy
    hc = HybridConfig(("linear_attention", "full_attention", "linear_attention"), 2, 4, 32, 32)
    cfg = ModelConfig(architecture="qwen35", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=256, hybrid=hc)
    loaded = load_dummy(cfg, "tiny", "cpu", WeightFormat("tri", 128, "int4"), dtype=torch.float32)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if name.endswith(("conv_weight", "A_log", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    fused = ModelRunner(loaded, max_seq_len=32, num_slots=2, prefill_chunk_size=8, fast_decode=True)
    eager = ModelRunner(loaded, max_seq_len=32, num_slots=2, prefill_chunk_size=8, fast_decode=False)
    assert fused.decoder is not None and eager.decoder is None
    for runner in (fused, eager):
        runner.prefill(runner.slot(0), [t % 256 for t in PROMPT[:9]])
        runner.prefill(runner.slot(1), [t % 256 for t in OTHER[:4]])
    for i in range(3):
        tokens = [PROMPT[9 + i] % 256, OTHER[4 + i] % 256]
        got = fused.decode_batch([fused.slot(0), fused.slot(1)], tokens)  # [2, V]
        want = eager.decode_batch([eager.slot(0), eager.slot(1)], tokens)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()  # at float32 the same int8 GEMVs as eager


def test_long_prefill_chunks_through_the_kernels_match_transformers(hybrid, monkeypatch):
    """Prompt chunks of several delta-rule chunks (64 positions each, a partial last one, a second prompt chunk
    starting from the first one's state) through the Triton chunked rule in the interpreter."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernels run compiled: test_graphed_hybrid_step_on_cuda_matches_the_cpu")
    import engine.kernels.deltanet_prefill as prefill
    monkeypatch.setenv("BONSAI_KERNELS_ON_CPU", "1")
    calls = []
    real = prefill.chunk_gated_delta_rule_triton
    monkeypatch.setattr(prefill, "chunk_gated_delta_rule_triton", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    model, loaded = hybrid
    runner = ModelRunner(loaded, max_seq_len=256, num_slots=1, prefill_chunk_size=100, fast_decode=True)
    ids = [(i * 37 + 11) % 49152 for i in range(150)]
    logits = runner.prefill(runner.slot(0), ids)  # [V]: chunks of 100 and 50 positions
    assert (logits - reference_logits(model, ids)[-1]).abs().max() <= TOL
    assert [s[1] for s in calls] == [100] * 3 + [50] * 3  # every DeltaNet layer (3 of 4) of both chunks took the kernels
