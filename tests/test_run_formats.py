"""Which run-time format each matrix gets: sensitive layers kept at more bits (the seed recipe's int4
q/k/v/o, for float sources rounded at load and for generated weights), the base-3 ternary layout
(chosen by model.ternary_layout, or by the memory plan when the 2-bit weights do not fit), and that a
matrix holds the same values whichever ternary layout carries it."""
from __future__ import annotations

import json

import pytest
import torch

from bonsai_cli.run_options import dummy_architecture
from engine.errors import BonsaiError
from engine.run.config import RunConfig
from engine.weights.formats import WeightFormat, linear_formats
from engine.weights.packed_linear import PackedLinear
from quant.packed_layout import dequantize

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def kinds(formats: dict, layer: int = 0) -> dict[str, str]:
    return {path.rsplit(".", 1)[1]: f.label for path, f in formats.items() if path.startswith(f"layers.{layer}.")}


def test_the_seed_recipe_formats_on_the_27b_shape():
    config, _ = dummy_architecture("dense-27b")
    formats = linear_formats(config, WeightFormat("tri", 128, "int4", QKVO, "int4"))
    for layer in (0, config.num_layers - 1):
        assert kinds(formats, layer) == {"wqkv": "int4 g128", "wo": "int4 g128", "w13": "tri g128", "w2": "tri g128"}
    assert formats["lm_head"].label == "int4 g128"
    # one part of a stacked matrix is enough to keep the whole matrix at more bits (never fewer than asked)
    assert kinds(linear_formats(config, WeightFormat("tri", 128, sensitive_layers=("k_proj",)))) == {
        "wqkv": "int4 g128", "wo": "tri g128", "w13": "tri g128", "w2": "tri g128"}
    # a pattern is a regular expression searched in the Hugging Face names: layer 3's down_proj only
    got = linear_formats(config, WeightFormat("tri", 128, sensitive_layers=(r"layers\.3\.mlp\.down",), sensitive_type="int8"))
    assert got["layers.3.feed_forward.w2"].label == "int8 g128" and got["layers.2.feed_forward.w2"].label == "tri g128"
    assert got["layers.13.feed_forward.w2"].label == "tri g128"  # not a substring match on "3."


def test_sensitive_patterns_are_checked():
    config, _ = dummy_architecture("qwen3-8b")
    with pytest.raises(BonsaiError, match=r"pattern 'qproj' matches no layer; the layers are .*q_proj") as e:
        linear_formats(config, WeightFormat("tri", sensitive_layers=("qproj",)))
    assert "\n" not in str(e.value)
    with pytest.raises(BonsaiError, match="model.sensitive_layers: .*not a valid regular expression"):
        RunConfig.from_dict({"model": {"path": "x", "sensitive_layers": "q_proj("}})
    with pytest.raises(BonsaiError, match="model.sensitive_bits: must be one of 1, 2, 4, 8, 16, got 3"):
        RunConfig.from_dict({"model": {"path": "x", "sensitive_layers": "q_proj", "sensitive_bits": 3}})
    with pytest.raises(BonsaiError, match="model.ternary_layout: 'b3' is not one of auto, 2bit, base3"):
        RunConfig.from_dict({"model": {"path": "x", "ternary_layout": "b3"}})
    cfg = RunConfig.from_dict({"model": {"path": "x", "quant_type": "tri", "sensitive_layers": " q_proj, o_proj ",
                                         "sensitive_bits": 8, "ternary_layout": "base3"}})
    assert cfg.model.weight_format == WeightFormat("tri", 128, "bf16", ("q_proj", "o_proj"), "int8", "base3")


def test_base3_where_the_shape_allows_it():
    config, _ = dummy_architecture("qwen3-8b")
    formats = linear_formats(config, WeightFormat("tri", 128, "int4", QKVO, ternary_layout="base3"))
    assert kinds(formats) == {"wqkv": "int4 g128", "wo": "int4 g128", "w13": "tri5 g128", "w2": "tri5 g128"}
    small, _ = dummy_architecture("qwen2.5-coder-0.5b")  # hidden 896: not a multiple of 256, so 2-bit there
    got = kinds(linear_formats(small, WeightFormat("tri", 64, ternary_layout="base3")))
    assert got == {"wqkv": "tri g64", "wo": "tri g64", "w13": "tri g64", "w2": "tri5 g64"}  # down_proj's K is 4864


SERVE = """model:
  path: dense-27b
  load_format: dummy
  quant_type: tri
  group_size: 128
  head_type: int4
  sensitive_layers: q_proj,k_proj,v_proj,o_proj
  sensitive_bits: 4
  kv_cache_quant: true
  kv_cache_bits: 4
  max_context: 1536
runtime:
  device: cuda:0
{memory}"""


def plan_json(tmp_path, capsys, memory: str, extra: str = "") -> dict:
    from bonsai_cli.main import main
    path = tmp_path / "serve.yaml"
    path.write_text(SERVE.replace("  sensitive_bits: 4\n", "  sensitive_bits: 4\n" + extra).format(memory=memory))
    main(["info", "configs/models/dense-27b.yaml", "--plan", str(path), "--json"])
    return json.loads(capsys.readouterr().out)


def test_auto_takes_base3_only_when_the_2bit_weights_do_not_fit(tmp_path, capsys):
    roomy = plan_json(tmp_path, capsys, "memory:\n  max_gpu_memory: 24GB\n")
    assert roomy["fits"] and "ternary_layout" not in [c["key"] for c in roomy["chosen_to_fit"]]
    tight = plan_json(tmp_path, capsys, "memory:\n  max_gpu_memory: 6GB\n  weight_offload: auto\n")
    two_bit = plan_json(tmp_path, capsys, "memory:\n  max_gpu_memory: 6GB\n  weight_offload: auto\n",
                        "  ternary_layout: 2bit\n")
    assert tight["fits"] and two_bit["fits"]
    assert [c["key"] for c in tight["chosen_to_fit"]][0] == "ternary_layout"
    assert "ternary_layout" not in [c["key"] for c in two_bit["chosen_to_fit"]]
    # fewer blocks stream, and fewer bytes each: the predicted decode speed is higher
    fast, slow = tight["weight_streaming"], two_bit["weight_streaming"]
    assert 0 < len(fast["streamed_layers"]) < len(slow["streamed_layers"])
    assert fast["streamed_bytes"] < slow["streamed_bytes"]
    assert fast["predicted_tokens_per_second"] > slow["predicted_tokens_per_second"]


@pytest.fixture(scope="module")
def tri_checkpoint(tmp_path_factory, smollm2_gguf):
    """A bonsai checkpoint of a tiny model whose matrices are base-3 packable (K = 256, 512)."""
    from engine.quantization.quantize import QuantizeOptions, quantize
    from quant.formats import QuantSpec
    from quant.recipe import Recipe, Rule
    from tests.gguf_tiny import write_tiny_gguf
    from tests.hf_tiny import write_tiny_hf
    from gguf import GGMLQuantizationType as T
    root = tmp_path_factory.mktemp("tri5")
    hf = write_tiny_hf(root / "hf", write_tiny_gguf(root / "t.gguf", smollm2_gguf, T.F32), hidden=256, ffn=512)
    recipe = Recipe(QuantSpec("tri", 128), rules=(Rule("o_proj", QuantSpec("int4", 128)),))
    quantize(hf, root / "ckpt", QuantizeOptions(recipe, evaluate=False))
    return hf, root / "ckpt"


def _logits(loaded, ids: list[int], fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from engine.runtime.runner import ModelRunner
    runner = ModelRunner(loaded, max_seq_len=32, fast_decode=fast)
    slot = runner.slot()
    prompt = runner.forward(slot, ids, num_logits=None)  # [T, V]: more rows than the packed kernels take
    return prompt, runner.forward(slot, [int(prompt[-1].argmax())])  # one decode row


@pytest.mark.parametrize("fast", [False, True])
def test_stored_ternary_codes_run_the_same_in_base3(tri_checkpoint, fast):
    """A checkpoint's ternary codes re-laid out in base-3 (no rounding) and its float source rounded at
    load in base-3: the matrices hold the 2-bit layout's values exactly, and the logits agree."""
    from engine.weights.loader import load_model
    hf, ckpt = tri_checkpoint
    ids = [5, 17, 300, 42, 9, 77, 123, 8]
    for source, fmt in ((ckpt, WeightFormat()), (hf, WeightFormat("tri", 128, "bf16", ("o_proj",)))):
        two = load_model(source, weight_dtype=torch.float32, weight_format=fmt, keep_codes=True)
        base3 = load_model(source, weight_dtype=torch.float32, keep_codes=True,
                           weight_format=WeightFormat(**{**vars(fmt), "ternary_layout": "base3"}))
        a, b = dict(two.model.named_modules()), dict(base3.model.named_modules())
        assert (b["layers.0.feed_forward.w13"].kind, b["layers.0.attention.wqkv"].kind,
                b["layers.0.attention.wo"].kind) == ("tri5", "tri5", "int4")
        for name, module in a.items():
            if isinstance(module, PackedLinear):
                assert torch.equal(dequantize(module.packed), dequantize(b[name].packed)), name
        packed = [(m.nbytes, b[name].nbytes) for name, m in a.items() if isinstance(m, PackedLinear) and m.kind == "tri"]
        assert packed and all(three < two_bit for two_bit, three in packed)  # the same codes in fewer bytes
        for x, y in zip(_logits(two, ids, fast), _logits(base3, ids, fast)):
            torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_base3_on_cuda_matches_2bit(tri_checkpoint):
    """On a GPU the base-3 kernels (GEMV at 1-16 rows, dequantization for prefill) give the 2-bit kernels'
    logits up to the float order of their sums."""
    from engine.weights.loader import load_model
    _, ckpt = tri_checkpoint
    ids = [5, 17, 300, 42, 9, 77, 123, 8]
    got = [_logits(load_model(ckpt, device="cuda", weight_format=WeightFormat(ternary_layout=layout)), ids, True)
           for layout in ("2bit", "base3")]
    for x, y in zip(*got):
        torch.testing.assert_close(y.float(), x.float(), atol=2e-2, rtol=2e-2)


def test_the_seed_recipe_quantized_and_generated_hold_the_same_formats(tri_checkpoint, tmp_path, capsys):
    """`bonsai quantize --quant-type tri --group-size 128 --sensitive-layers q_proj,k_proj,v_proj,o_proj
    --sensitive-bits 4 --head-bits 4` of a float model, loaded, holds per layer the formats load_format: dummy
    makes from the same keys in a serve config."""
    from bonsai_cli.main import main
    from engine.sources.checkpoint_file import BonsaiCheckpoint
    from engine.weights.formats import stored_formats
    hf, _ = tri_checkpoint
    out = tmp_path / "seed"
    try:
        main(["quantize", str(hf), str(out), "--method", "rtn", "--no-eval", "--quant-type", "tri", "--group-size",
              "128", "--sensitive-layers", ",".join(QKVO), "--sensitive-bits", "4", "--head-bits", "4"])
    except SystemExit as e:
        assert not e.code, capsys.readouterr().err
    source = BonsaiCheckpoint(out)
    config = source.model_config()
    quantized = linear_formats(config, WeightFormat(), stored_formats(source))
    generated = linear_formats(config, RunConfig.from_dict({"model": {
        "path": "x", "quant_type": "tri", "group_size": 128, "head_type": "int4",
        "sensitive_layers": ",".join(QKVO), "sensitive_bits": 4}}).model.weight_format)
    assert quantized == generated
    assert kinds(quantized) == {"wqkv": "int4 g128", "wo": "int4 g128", "w13": "tri g128", "w2": "tri g128"}
    assert quantized["lm_head"].label == "int4 g128"
