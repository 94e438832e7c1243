"""PrismML's folded Hadamard rotation (`prism.hadamard.*`): a rotated GGUF against the same model unrotated
(float weights: prefill, token-by-token decode, the fused decode step, a verify pass; ternary PQ2_0 weights
folded in the rotated basis against dequantize-then-unfold), the metadata's refusals, and `bonsai info`.

The fold is built here with numpy alone (dense Sylvester matrices): for R(x) = (I ⊗ H_b/√b)·(x ⊙ s),
W' = W·diag(s)·(I ⊗ H_b/√b) gives W' R(x) = W x, and the same map on the embedding's rows gives
E'[t] with R⁻¹(E'[t]) = (I ⊗ H_b/√b) E'[t] ⊙ s = E[t]."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from gguf import GGUFWriter

from engine.errors import BonsaiError
from engine.runtime.runner import ModelRunner
from engine.sources import prism_rotation
from engine.sources.gguf_file import GGUFFile
from engine.weights.loader import load_model
from quant import gguf_codec
from quant.formats import QuantSpec, quantize_rtn
from quant.grids import dequantize
from tests.gguf_tiny import copy_tokenizer

IDS = [5, 17, 300, 42, 9, 1000, 77, 3, 64, 128, 256, 511]
SHAPES = {"llama": dict(hidden=128, heads=4, kv=2, head_dim=32, ffn=256),
          "qwen3": dict(hidden=128, heads=4, kv=2, head_dim=48, ffn=192)}  # o_proj reads 192 ≠ hidden
LAYERS = 2
PREFIX = "prism.hadamard."


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def fold(m: np.ndarray, signs: np.ndarray, block: int) -> np.ndarray:
    """M [rows, K] → (M ⊙ s) · (I ⊗ H_b/√b): a weight folded forward, or an embedding folded inverse."""
    return ((m * signs) @ np.kron(np.eye(m.shape[1] // block), sylvester(block))).astype(np.float32)


def unfold(m: np.ndarray, signs: np.ndarray, block: int) -> np.ndarray:
    """fold's inverse: (M · (I ⊗ H_b/√b)) ⊙ s."""
    return ((m @ np.kron(np.eye(m.shape[1] // block), sylvester(block))) * signs).astype(np.float32)


def random_tensors(arch: str, vocab: int, seed: int, tied: bool = False) -> dict[str, np.ndarray]:
    s = SHAPES[arch]
    rng = np.random.default_rng(seed)
    h, q, kv, f = s["hidden"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["ffn"]

    def w(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    out = {"token_embd.weight": w(vocab, h), "output_norm.weight": norm(h)}
    for i in range(LAYERS):
        p = f"blk.{i}"
        out.update({f"{p}.attn_norm.weight": norm(h), f"{p}.attn_q.weight": w(q, h), f"{p}.attn_k.weight": w(kv, h),
                    f"{p}.attn_v.weight": w(kv, h), f"{p}.attn_output.weight": w(h, q), f"{p}.ffn_norm.weight": norm(h),
                    f"{p}.ffn_gate.weight": w(f, h), f"{p}.ffn_up.weight": w(f, h), f"{p}.ffn_down.weight": w(h, f)})
        if arch == "qwen3":
            out.update({f"{p}.attn_q_norm.weight": norm(s["head_dim"]), f"{p}.attn_k_norm.weight": norm(s["head_dim"])})
    if not tied:
        out["output.weight"] = w(vocab, h)
    return out


def prism_meta(block: int, signs: dict[int, np.ndarray] | None, names: list[str], inverse: list[str]) -> dict:
    meta = {"version": (1, V.UINT32), "block_size": (block, V.UINT32),
            "transform": ("normalized-sylvester-walsh-hadamard", V.STRING), "axis": ("input-last-dimension", V.STRING),
            "sign_mode": ("identity" if signs is None else "explicit", V.STRING),
            "weight_names": (names, V.ARRAY), "inverse_weight_names": (inverse, V.ARRAY),
            "gdn_v_grouped": (False, V.BOOL)}
    if signs is not None:
        meta["sign_widths"] = (list(signs), V.ARRAY)
        meta["sign_values"] = ([int(v) for s in signs.values() for v in s], V.ARRAY)
    return {PREFIX + k: v for k, v in meta.items() if v[0] != []}  # the gguf package writes no empty array


def write_gguf(path, tokenizer_source, arch: str, tensors: dict[str, np.ndarray], meta: dict | None = None,
               raw: dict[str, tuple[int, np.ndarray]] | None = None):
    """A GGUF of float32 tensors, `raw` ones as (type id, blocks uint8 [rows, bytes]) the gguf package does
    not know (written as I8 bytes, their type and width patched in the header)."""
    s = SHAPES[arch]
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    copy_tokenizer(writer, tokenizer_source)
    for key, (value, vtype) in (meta or {}).items():
        sub = None
        if vtype == V.ARRAY:
            sub = V.STRING if value and isinstance(value[0], str) else V.INT32
        writer.add_key_value(key, value, vtype, sub_type=sub)
    raw = raw or {}
    for name, array in tensors.items():
        if name in raw:
            writer.add_tensor(name, raw[name][1].view(np.int8), raw_dtype=T.I8)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    for name, (type_id, blocks) in raw.items():
        key = len(name).to_bytes(8, "little") + name.encode()
        at = data.rindex(key) + len(key)  # (the tensor infos follow the metadata) n_dims u32, dims u64 x2, type u32
        data[at + 4:at + 12] = tensors[name].shape[1].to_bytes(8, "little")
        data[at + 20:at + 24] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def widths(arch: str) -> dict[str, int]:
    s = SHAPES[arch]
    return {"hidden": s["hidden"], "q": s["heads"] * s["head_dim"], "ffn": s["ffn"]}


def input_width(name: str, arch: str) -> int:
    w = widths(arch)
    return w["q"] if "attn_output" in name else w["ffn"] if "ffn_down" in name else w["hidden"]


def rotated_copy(tensors: dict[str, np.ndarray], arch: str, names: list[str], embedding: bool, block: int,
                 signs: dict[int, np.ndarray] | None) -> dict[str, np.ndarray]:
    out = dict(tensors)
    for name in names + (["token_embd.weight"] if embedding else []):
        width = input_width(name, arch)
        s = np.ones(width) if signs is None else signs[width]
        out[name] = fold(tensors[name], s, block)
    return out


def all_linears(tied: bool = False) -> list[str]:
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    return [f"blk.{i}.{p}.weight" for i in range(LAYERS) for p in parts] + ([] if tied else ["output.weight"])


def logits_every_way(path, device: str = "cpu", **load) -> dict[str, torch.Tensor]:
    """One prompt's logits: a prefill pass (every row), token-by-token eager decoding, the fused decode step
    (the kernels' CPU references; on CUDA the Triton kernels, graphed) and a speculative verify pass through it."""
    loaded = load_model(path, device, weight_dtype=torch.float32 if device == "cpu" else None, **load)
    out = {}
    eager = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    out["prefill"] = eager.forward(eager.slot(), IDS, num_logits=None)  # [T, V]
    eager.slot().reset()
    eager.forward(eager.slot(), IDS[:4])
    out["decode"] = torch.cat([eager.forward(eager.slot(), [t]) for t in IDS[4:]])  # [T-4, V]
    fused = ModelRunner(loaded, max_seq_len=64, fast_decode=True)
    assert fused.decoder is not None
    fused.forward(fused.slot(), IDS[:4])
    out["fused"] = torch.cat([fused.forward(fused.slot(), [t]) for t in IDS[4:8]])  # [4, V]
    out["verify"] = fused.verify(fused.slot(), IDS[8:])[0]  # [4, V]
    return {key: logits.float().cpu() for key, logits in out.items()}


def assert_same(got: dict, want: dict, atol: float) -> None:
    want = {**want, "decode": want["prefill"][4:], "fused": want["prefill"][4:8], "verify": want["prefill"][8:]}
    for key in got:
        err = float((got[key] - want[key]).abs().max())
        assert err <= atol * float(want[key].abs().max()), (key, err)


@pytest.fixture(scope="module")
def vocab(smollm2_gguf):
    return len(GGUFFile(smollm2_gguf).metadata["tokenizer.ggml.tokens"][:1024])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_fully_rotated_file_computes_the_unrotated_model(arch, tmp_path, smollm2_gguf, vocab, one_thread):
    """Every projection, the output layer and the embedding folded, explicit random signs per width
    (hidden, o_proj's input, the FFN width), block 32 < the widths."""
    plain = random_tensors(arch, vocab, seed=1)
    rng = np.random.default_rng(2)
    signs = {w: rng.choice([-1.0, 1.0], w) for w in sorted(set(widths(arch).values()))}
    folded = rotated_copy(plain, arch, all_linears(), True, 32, signs)
    ref = write_gguf(tmp_path / "plain.gguf", smollm2_gguf, arch, plain)
    rot = write_gguf(tmp_path / "rot.gguf", smollm2_gguf, arch, folded,
                     prism_meta(32, signs, all_linears(), ["token_embd.weight"]))
    want = logits_every_way(ref)
    assert_same(logits_every_way(rot), want, 1e-4)
    streamed = ModelRunner(load_model(rot, weight_dtype=torch.float32), max_seq_len=64, fast_decode=False,
                           offload_layers={1})  # block 1's weights and rotations streamed from host memory
    assert streamed.weight_stream is not None
    assert_same({"prefill": streamed.forward(streamed.slot(), IDS, num_logits=None)}, want, 1e-4)
    # the planted bug: the folded weights read unrotated inputs
    loaded = load_model(rot, weight_dtype=torch.float32)
    for block in loaded.model.layers:
        assert block.attention.wqkv_rotation is not None and block.feed_forward.w2_rotation.block == 32
        block.attention.wqkv_rotation = None
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=False)
    bad = runner.forward(runner.slot(), IDS, num_logits=None)
    assert float((bad - want["prefill"]).abs().max()) > 0.05 * float(want["prefill"].abs().max())


def test_pipeline_stages_take_the_rotations_of_their_own_blocks(tmp_path, smollm2_gguf, vocab, one_thread):
    """Two stages (layer 0 + embedding, layer 1 + head) of a rotated file chained = the unrotated model."""
    from engine.pipeline.split import Stage
    from engine.runtime.kv_cache import CacheBatch, KVCache
    plain = random_tensors("llama", vocab, seed=8)
    signs = {w: np.random.default_rng(9).choice([-1.0, 1.0], w) for w in (128, 256)}
    ref = write_gguf(tmp_path / "plain.gguf", smollm2_gguf, "llama", plain)
    rot = write_gguf(tmp_path / "rot.gguf", smollm2_gguf, "llama", rotated_copy(plain, "llama", all_linears(), True, 32, signs),
                     prism_meta(32, signs, all_linears(), ["token_embd.weight"]))
    want = logits_every_way(ref)["prefill"]
    x = torch.tensor([IDS])
    for first, end in ((0, 1), (1, 2)):
        model = load_model(rot, weight_dtype=torch.float32, stage=Stage(first, 2, "cpu", first, end)).model
        assert (model.lm_head_rotation is not None) == (end == 2) and len(model.layers) == 1
        assert model.layers[0].feed_forward.w2_rotation is not None
        cache = KVCache(dataclasses.replace(model.config, num_layers=1), 64, 1)
        x, _ = model.forward_hidden(x, CacheBatch.make([0], [0], len(IDS), "cpu"), cache, len(IDS), None)
    torch.testing.assert_close(x[0], want, atol=1e-4 * float(want.abs().max()), rtol=0)


def test_a_partly_rotated_tied_file_with_identity_signs(tmp_path, smollm2_gguf, vocab, one_thread):
    """Mixed readers (layer 0's q/k/v and layer 1's down projection folded, the rest plain), identity
    signs, block 64, and a tied output layer: it reads the embedding as the table un-rotated at load,
    E h = E' R(h), so it needs no rotation of its own."""
    plain = random_tensors("llama", vocab, seed=3, tied=True)
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.1.ffn_down.weight"]
    folded = rotated_copy(plain, "llama", names, True, 64, None)
    ref = write_gguf(tmp_path / "plain.gguf", smollm2_gguf, "llama", plain)
    rot = write_gguf(tmp_path / "rot.gguf", smollm2_gguf, "llama", folded, prism_meta(64, None, names, ["token_embd.weight"]))
    assert_same(logits_every_way(rot), logits_every_way(ref), 1e-4)
    model = load_model(rot, weight_dtype=torch.float32).model
    assert model.layers[1].attention.wqkv_rotation is None and model.layers[0].feed_forward.w2_rotation is None
    assert model.lm_head_rotation is None and model.layers[1].feed_forward.w2_rotation.signs is None


def pq2_files(tmp_path, smollm2_gguf, vocab: int):
    """(an independent float file of W = unfold(dequantize(W')), the rotated file of ternary PQ2_0 codes W')."""
    plain = random_tensors("llama", vocab, seed=4)
    rng = np.random.default_rng(5)
    signs = {w: rng.choice([-1.0, 1.0], w) for w in (128, 256)}
    names = all_linears()
    stored, raw, reference = dict(plain), {}, dict(plain)
    for name in names:
        codes, scales = quantize_rtn(QuantSpec("tri", 128), torch.from_numpy(plain[name]))
        raw[name] = (gguf_codec.PQ2_0_ID, gguf_codec.encode(codes, scales, 128, gguf_codec.PQ2_0_ID)[0])
        w_folded = dequantize(codes, scales.half().float(), 128).numpy()  # what the file's W' decodes to
        stored[name] = w_folded
        reference[name] = unfold(w_folded, signs[input_width(name, "llama")], 32)
    ref = write_gguf(tmp_path / "ref.gguf", smollm2_gguf, "llama", reference)
    rot = write_gguf(tmp_path / "rot.gguf", smollm2_gguf, "llama", stored,
                     prism_meta(32, signs, names, []), raw=raw)
    return ref, rot


@pytest.mark.gpu
def test_a_rotated_ternary_file_on_the_gpu(tmp_path, smollm2_gguf, vocab):
    """The rotated PQ2_0 file on CUDA: its codes packed as stored through the Triton kernels (the activations
    rotated before their int8 quantization), the decode step graphed, bf16 activations: the CPU float32
    logits of the unrotated W to the activations' rounding."""
    ref, rot = pq2_files(tmp_path, smollm2_gguf, vocab)
    assert_same(logits_every_way(rot, "cuda", keep_codes=True), logits_every_way(ref), 0.08)


def test_ternary_pq2_weights_in_the_rotated_basis(tmp_path, smollm2_gguf, vocab, one_thread):
    """Ternary PQ2_0 codes stand for the folded weights W'; the reference is an independent float file of
    W = unfold(dequantize(W')). Loaded as floats it matches tightly; served packed as stored (int8
    activations, through the rotation before the quantization) it matches to the activations' rounding."""
    ref, rot = pq2_files(tmp_path, smollm2_gguf, vocab)
    want = logits_every_way(ref)
    assert_same(logits_every_way(rot, keep_codes=False), want, 1e-4)
    packed = logits_every_way(rot, keep_codes=True)
    assert_same(packed, want, 0.05)  # int8 activations: ~0.03 of the largest logit here, rotated or not
    # the fused step quantizes the same rotated activations as the eager packed layers do
    torch.testing.assert_close(packed["fused"], packed["decode"][:4], atol=1e-4 * float(want["prefill"].abs().max()), rtol=0)
    loaded = load_model(rot, weight_dtype=torch.float32, keep_codes=True)
    assert type(loaded.model.layers[0].feed_forward.w2).__name__ == "PackedLinear"
    loaded.model.lm_head_rotation = None  # the planted bug: the packed head reads an unrotated input
    runner = ModelRunner(loaded, max_seq_len=64, fast_decode=True)
    runner.forward(runner.slot(), IDS[:4])
    bad = torch.cat([runner.forward(runner.slot(), [t]) for t in IDS[4:8]])
    assert float((bad - want["prefill"][4:8]).abs().max()) > 0.2 * float(want["prefill"].abs().max())


# ---- the metadata: checked on its own, then placed on the model ----

def parsed_meta(**changes) -> dict:
    """Plain-value metadata of a rotated llama (as GGUFFile.metadata holds it), with keys changed or dropped (None)."""
    signs = {128: [1, -1] * 64, 256: [-1, 1] * 128}
    meta = {k: v for k, (v, _) in prism_meta(32, signs, all_linears(), ["token_embd.weight"]).items()}
    for key, value in changes.items():
        if value is None:
            meta.pop(PREFIX + key, None)
        else:
            meta[PREFIX + key] = value
    return meta


def test_the_metadata_is_read_into_signs_per_width():
    rot = prism_rotation.parse(parsed_meta(), "m.gguf")
    assert rot.block == 32 and sorted(rot.signs) == [128, 256] and rot.signs[256][:3] == (-1, 1, -1)
    assert rot.weight_names == tuple(all_linears()) and rot.inverse_names == ("token_embd.weight",)
    spec = rot.spec(256, "blk.0.ffn_down.weight", "m.gguf")
    assert (spec.width, spec.block, spec.signs[:2]) == (256, 32, (-1, 1))
    identity = prism_rotation.parse(parsed_meta(sign_mode="identity", sign_widths=None, sign_values=None), "m.gguf")
    assert identity.signs is None and identity.spec(128, "x", "m.gguf").signs is None
    assert prism_rotation.parse({"general.architecture": "llama"}, "m.gguf") is None


@pytest.mark.parametrize("changes,message", [
    (dict(version=2), "version is 2; bonsai reads version 1"),
    (dict(version=None), "version is missing"),
    (dict(transform="sequency-walsh"), "transform is 'sequency-walsh'; bonsai applies only 'normalized-sylvester"),
    (dict(axis="output-first-dimension"), "axis is 'output-first-dimension'"),
    (dict(sign_mode="random"), "sign_mode is 'random'; bonsai reads 'explicit' and 'identity'"),
    (dict(sign_widths=[128, 255]), "sign_values holds 384 signs but sign_widths .128, 255. need 383"),
    (dict(sign_widths=[128, 128]), "are not distinct positive widths"),
    (dict(sign_values=[1, 0] * 192), "sign_values holds 0, not .1 or -1"),
    (dict(block_size=48), "block_size 48 is not a power of two"),
    (dict(block_size=True), "block_size is True, not int"),
    (dict(sign_mode="identity"), "sign_mode is 'identity' but the file carries sign values"),
    (dict(weight_names=["blk.0.ffn_down.weight", 3]), "weight_names holds something other than tensor names"),
    (dict(seed=7), "carries prism.hadamard.seed, a Hadamard rotation setting bonsai does not know"),
])
def test_bad_metadata_is_refused_in_one_line(changes, message):
    with pytest.raises(BonsaiError, match=message) as e:
        prism_rotation.parse(parsed_meta(**changes), "m.gguf")
    assert "\n" not in str(e.value) and str(e.value).startswith("m.gguf")


@pytest.mark.parametrize("changes,message", [
    (dict(weight_names=["blk.0.attn_q.weight", "blk.0.attn_k.weight"]),
     "lists blk.0.attn_q.weight but not blk.0.attn_v.weight, which bonsai computes in one product with it"),
    (dict(weight_names=["blk.0.attn_norm.weight"]), "lists blk.0.attn_norm.weight, which bonsai cannot place"),
    (dict(weight_names=["blk.0.ssm_out.weight"]), "lists blk.0.ssm_out.weight, a tensor the file lacks"),
    (dict(inverse_weight_names=["output.weight"]), "bonsai undoes the rotation of token_embd.weight only"),
    (dict(block_size=256), "block 256 does not divide the width 128 of blk.0.attn_q.weight's input"),
    (dict(sign_widths=[128, 128 * 2 - 64, 64], sign_values=[1] * 384), "has no signs for the width 256"),
])
def test_rotations_the_model_cannot_take_are_refused(changes, message, tmp_path, smollm2_gguf, vocab):
    tensors = random_tensors("llama", vocab, seed=6)
    meta = prism_meta(32, {128: np.ones(128), 256: np.ones(256)}, all_linears(), ["token_embd.weight"])
    for key, value in changes.items():
        meta[PREFIX + key] = (value, V.UINT32 if isinstance(value, int) else meta[PREFIX + key][1])
    path = write_gguf(tmp_path / "m.gguf", smollm2_gguf, "llama", tensors, meta)
    with pytest.raises(BonsaiError, match=message) as e:
        GGUFFile(path).model_config()
    assert "\n" not in str(e.value)


def test_info_shows_the_rotation_and_quantize_refuses_it(tmp_path, smollm2_gguf, vocab, capsys):
    from tests.test_quantize_cli import cli
    plain = random_tensors("llama", vocab, seed=7)
    names = ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight", "output.weight"]
    signs = {256: np.ones(256), 128: -np.ones(128)}
    path = write_gguf(tmp_path / "rot.gguf", smollm2_gguf, "llama", rotated_copy(plain, "llama", names, True, 64, signs),
                      prism_meta(64, signs, names, ["token_embd.weight"]))
    code, stdout, err = cli(capsys, "info", str(path), "--json")
    assert code == 0, err
    assert json.loads(stdout)["rotation"] == {"kind": "prism-hadamard", "block": 64, "sign_widths": [128, 256],
                                              "weights": 3, "embedding": True}
    code, stdout, _ = cli(capsys, "info", str(path))
    text = " ".join(stdout.split())  # the table wraps long cells
    assert code == 0 and "Prism Hadamard, block 64 (signs for widths 128, 256) on the inputs of 3 weights" in text
    code, _, err = cli(capsys, "quantize", "--method", "rtn", str(path), str(tmp_path / "q"), "--quant-type", "int8")
    assert code == 1 and "holds PrismML's folded Hadamard rotation" in err
