"""`bonsai quantize` (rtn) on a tiny hybrid model: the checkpoint loads and runs close to the float model;
what has no hybrid path yet (--rotate, gptq / gsq) is refused in one line."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_5")

from engine.errors import BonsaiError  # noqa: E402
from engine.quantization.quantize import QuantizeOptions, quantize  # noqa: E402
from engine.runtime.runner import ModelRunner  # noqa: E402
from engine.weights.loader import load_model  # noqa: E402
from quant.formats import QuantSpec  # noqa: E402
from quant.recipe import Recipe  # noqa: E402
from tests.hybrid_tiny import make_hybrid_model  # noqa: E402

IDS = [(i * 29 + 3) % 64 for i in range(24)]


@pytest.fixture(scope="module")
def source(tmp_path_factory, smollm2_gguf):
    import transformers
    tok = tmp_path_factory.mktemp("tok")
    transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name).save_pretrained(tok)
    path = tmp_path_factory.mktemp("qwen35")
    make_hybrid_model(path, tok, vocab_size=64)
    return path


def _logits(path) -> torch.Tensor:
    runner = ModelRunner(load_model(path, dtype=torch.float32, weight_dtype=torch.float32), 64, prefill_chunk_size=8)
    return runner.forward(runner.slot(0), IDS, num_logits=None)  # [T, V]


def test_int8_rtn_checkpoint_runs_close_to_the_float_model(source, tmp_path):
    out = tmp_path / "q"
    quantize(source, out, QuantizeOptions(Recipe(QuantSpec("int8", 32)), evaluate=False))
    ref, got = _logits(source), _logits(out)
    p, q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)  # [T]
    assert kl.max() < 1e-3 and not torch.equal(ref, got)  # quantized, and close


@pytest.mark.parametrize("change, message", [(dict(rotate=True), "--rotate"), (dict(method="gptq"), "--method gptq")])
def test_what_has_no_hybrid_path_is_refused(source, tmp_path, change, message):
    opts = replace(QuantizeOptions(Recipe(QuantSpec("tri", 32)), evaluate=False), **change)
    with pytest.raises(BonsaiError, match=message):
        quantize(source, tmp_path / "q", opts)
