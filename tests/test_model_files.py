"""Issue 24, classes 5 and 6: a corrupt or hostile model file is one line naming the file, the field
and what is wrong, found before anything is allocated: the GGUF header against the bytes left
and GGML's rules (engine.sources.gguf_reader), the architecture against sane limits (engine.sources.model_limits),
the tensor inventory against the architecture, layer count first (engine.sources.model_check), so a config
claiming a million layers is refused before the model is built. `info` and `generate` say the same."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from engine.errors import ModelFileError, UnsupportedModelError
from engine.sources.gguf_file import GGUFFile
from engine.sources.gguf_reader import GGUFFormatError, read_gguf
from tests.gguf_tiny import write_tiny_gguf
from tests.hf_tiny import write_tiny_hf
from tests.test_cli_errors import assert_one_line_error, bonsai_in_process


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tmp_path_factory.mktemp("files")


@pytest.fixture(scope="module")
def good_gguf(files, smollm2_gguf):
    return write_tiny_gguf(files / "good.gguf", smollm2_gguf)


@pytest.fixture
def no_building(monkeypatch):
    """Refusals must come before the model is built: building it here fails the test."""
    import engine.weights.loader

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the file was refused")

    monkeypatch.setattr(engine.weights.loader, "_empty_model", built)


def refused(capsys, path: Path, *fragments: str) -> str:
    """`bonsai info PATH` and `bonsai generate PATH` both refuse it in one line with the fragments."""
    lines = []
    for args in (("info", str(path)), ("generate", str(path), "--prompt", "hi", "-n", "1")):
        proc = bonsai_in_process(capsys, *args)
        assert_one_line_error(proc, str(path))
        line = proc.stderr.strip().splitlines()[-1]
        assert "internal error" not in line and all(f in line for f in fragments), line
        lines.append(line)
    assert lines[0] == lines[1]  # info checks what generate checks
    return lines[0]


GGUF_CASES = [
    ({"general.alignment": (0, V.UINT32)}, "general.alignment is 0"),
    ({"general.alignment": (48, V.UINT32)}, "general.alignment is 48"),
    ({"general.alignment": ("32", V.STRING)}, "general.alignment is '32'"),
    ({"llama.attention.head_count": (0, V.UINT32)}, "llama.attention.head_count is 0"),
    ({"llama.attention.head_count_kv": (0, V.UINT32)}, "llama.attention.head_count_kv is 0"),
    ({"llama.attention.head_count_kv": (3, V.UINT32)}, "not a multiple of num_kv_heads"),
    ({"llama.embedding_length": (2**31, V.UINT32)}, "llama.embedding_length is 2147483648; it must be in 1..65536"),
    ({"llama.embedding_length": (0, V.UINT32)}, "llama.embedding_length is 0"),
    ({"llama.embedding_length": (64, V.UINT32)}, "token_embd.weight has shape [1024, 256] but the architecture"),
    ({"llama.feed_forward_length": ("512", V.STRING)}, "llama.feed_forward_length is '512'; it must be a whole"),
    ({"llama.feed_forward_length": (1024, V.UINT32)}, "blk.0.ffn_gate.weight has shape [512, 256]"),
    ({"llama.block_count": (100_000, V.UINT32)}, "llama.block_count is 100000; it must be in 1..1024"),
    ({"llama.block_count": (500, V.UINT32)}, "llama.block_count is 500 but the file holds tensors of 2 layers"),
    ({"llama.block_count": (1, V.UINT32)}, "llama.block_count is 1 but the file holds tensors of 2 layers"),
    ({"llama.block_count": None}, "llama.block_count is missing"),
    ({"llama.context_length": (0, V.UINT32)}, "llama.context_length is 0"),
    ({"llama.attention.layer_norm_rms_epsilon": (math.nan, V.FLOAT32)}, "layer_norm_rms_epsilon is nan"),
    ({"llama.rope.freq_base": (-1.0, V.FLOAT32)}, "llama.rope.freq_base is -1.0"),
    ({"llama.vocab_size": (2**40, V.UINT64)}, "llama.vocab_size is 1099511627776"),
    ({"tokenizer.ggml.bos_token_id": (10**6, V.UINT32)}, "bos_token_id = 1000000 is outside"),
]


@pytest.mark.parametrize("meta, fragment", GGUF_CASES, ids=[f for _, f in GGUF_CASES])
def test_hostile_gguf_metadata_is_one_line_naming_the_file_and_key(files, smollm2_gguf, capsys, no_building,
                                                                   meta, fragment):
    path = write_tiny_gguf(files / "bad.gguf", smollm2_gguf, T.F16, meta=meta)
    refused(capsys, path, fragment)


def test_a_missing_tensor_is_named_as_the_file_names_it(files, smollm2_gguf, capsys, no_building):
    path = write_tiny_gguf(files / "missing.gguf", smollm2_gguf, T.F16, skip=frozenset({"blk.1.ffn_down.weight"}))
    refused(capsys, path, "lacks tensors the architecture needs: blk.1.ffn_down.weight")


# -- the header itself: lengths, counts and tensor infos, written byte by byte --------------------------------
def _s(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def raw_gguf(path: Path, kv: list[bytes] = (), tensors: list[bytes] = (), n_kv: int | None = None,
             n_tensors: int | None = None, tail: bytes = b"\0" * 256) -> Path:
    head = b"GGUF" + struct.pack("<I", 3) + struct.pack("<Q", len(tensors) if n_tensors is None else n_tensors)
    head += struct.pack("<Q", len(kv) if n_kv is None else n_kv)
    path.write_bytes(head + b"".join(kv) + b"".join(tensors) + tail)
    return path


def kv_u32(key: str, value: int) -> bytes:
    return _s(key) + struct.pack("<II", 4, value)


def info(name: str, dims: list[int], type_id: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", type_id, offset)


HEADER_CASES = [
    ("string length 2^40", dict(kv=[struct.pack("<Q", 1 << 40) + b"key"]), "length is 1099511627776, more than"),
    ("key count 2^39", dict(n_kv=1 << 39), "the metadata key count is 549755813888"),
    ("tensor count 2^40", dict(n_tensors=1 << 40), "the tensor count is 1099511627776"),
    ("array of 2^39 uint32", dict(kv=[_s("a") + struct.pack("<IIQ", 9, 4, 1 << 39)]), "the item count of a is"),
    ("array of 2^39 strings", dict(kv=[_s("a") + struct.pack("<IIQ", 9, 8, 1 << 39)]), "the item count of a is"),
    ("arrays nested 6 deep", dict(kv=[_s("a") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 6 +
                                      struct.pack("<IQ", 4, 0)]), "a nests arrays more than 4 deep"),
    ("unknown value type", dict(kv=[_s("a") + struct.pack("<I", 77)]), "a has an unknown metadata value type 77"),
    ("a key twice", dict(kv=[kv_u32("a", 1), kv_u32("a", 2)]), "the metadata key a appears twice"),
    ("alignment 0", dict(kv=[kv_u32("general.alignment", 0)]), "general.alignment is 0"),
    ("5 dimensions", dict(tensors=[info("t", [1, 1, 1, 1, 1])]), "tensor t has 5 dimensions"),
    ("2^31 dimensions", dict(tensors=[_s("t") + struct.pack("<I", 1 << 31)]), "tensor t has 2147483648 dimensions"),
    ("a zero dimension", dict(tensors=[info("t", [4, 0])]), "tensor t has a zero dimension"),
    ("dimensions overflowing", dict(tensors=[info("t", [1 << 40, 1 << 40])]), "overflow"),
    ("rows not whole blocks", dict(tensors=[info("t", [33, 2], type_id=8)]), "not a whole number of Q8_0 blocks of 32"),
    ("unaligned offset", dict(tensors=[info("t", [4], offset=4)]), "offset 4 is not a multiple of general.alignment"),
    ("past the end", dict(tensors=[info("t", [1 << 20])]), "extends past the end of the file"),
    ("a tensor twice", dict(tensors=[info("t", [4]), info("t", [4], offset=32)]), "tensor t appears twice"),
    ("unknown type", dict(tensors=[info("t", [4], type_id=99)]), "unknown type id 99"),
]


@pytest.mark.parametrize("kw, fragment", [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES])
def test_a_hostile_header_is_refused_before_anything_is_read_for_it(files, kw, fragment):
    path = raw_gguf(files / "raw.gguf", **kw)
    with pytest.raises(GGUFFormatError, match=fragment.replace("^", r"\^")):
        read_gguf(path)
    # a type id nobody knows is not a damaged file: it is refused as unsupported, naming what is read
    with pytest.raises(UnsupportedModelError if "unknown type" in fragment else ModelFileError) as e:
        GGUFFile(path)
    assert str(path) in str(e.value) and fragment in str(e.value)


def test_a_well_formed_header_still_reads(files):
    path = raw_gguf(files / "ok.gguf", kv=[kv_u32("general.alignment", 64), _s("s") + struct.pack("<I", 8) + _s("é")],
                    tensors=[info("t", [4, 2], offset=0)])
    meta, tensors, _ = read_gguf(path)
    assert meta == {"general.alignment": 64, "s": "é"} and tensors[0].shape == (2, 4)
    assert tensors[0].offset % 64 == 0 and tensors[0].nbytes == 32


# -- config.json ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_hf(files, good_gguf):
    return write_tiny_hf(files / "good-hf", good_gguf)


HF_CASES = [
    (lambda c: [c], "config.json holds a JSON list"),
    (lambda c: "llama", "config.json holds a JSON str"),
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "hidden_size is missing"),
    (lambda c: {**c, "vocab_size": 1e10}, "vocab_size is 10000000000; it must be in 1..2097152"),
    (lambda c: {**c, "hidden_size": "64"}, "hidden_size is '64'; it must be a whole number"),
    (lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads is 0"),
    (lambda c: {**c, "num_hidden_layers": 1_000_000}, "num_hidden_layers is 1000000"),
    (lambda c: {**c, "num_hidden_layers": 5}, "num_hidden_layers is 5 but the file holds tensors of 2 layers"),
    (lambda c: {**c, "head_dim": 0}, "head_dim is 0"),
    (lambda c: {**c, "intermediate_size": 100}, "model.layers.0.mlp.gate_proj.weight has shape [128, 64]"),
    (lambda c: {**c, "rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor is missing"),
    (lambda c: {**c, "rope_scaling": "yes"}, "rope_scaling is 'yes'; it must be an object"),
    (lambda c: {**c, "rms_norm_eps": "x"}, "rms_norm_eps is 'x'; it must be a finite number"),
    (lambda c: {**c, "max_position_embeddings": -1}, "max_position_embeddings is -1"),
    (lambda c: {**c, "tie_word_embeddings": True, "vocab_size": 999}, "has shape [1024, 64]"),
]


@pytest.mark.parametrize("edit, fragment", HF_CASES, ids=[f for _, f in HF_CASES])
def test_a_hostile_config_json_is_one_line_naming_the_key(good_hf, files, capsys, no_building, edit, fragment):
    import shutil
    bad = files / "bad-hf"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(good_hf, bad)
    config = json.loads((good_hf / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(edit(config)))
    refused(capsys, bad, fragment)


def test_an_odd_architectures_field_falls_back_to_model_type(good_hf, files, capsys):
    import shutil
    odd = files / "odd-hf"
    shutil.rmtree(odd, ignore_errors=True)
    shutil.copytree(good_hf, odd)
    config = json.loads((good_hf / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": 5}))
    proc = bonsai_in_process(capsys, "info", str(odd))
    assert proc.returncode == 0, proc.stderr


# -- unreadable files ----------------------------------------------------------------------------------------
@pytest.fixture
def unreadable(monkeypatch):
    """open() and Path.read_text() of the named file raise PermissionError (chmod does not stop root)."""
    import builtins
    blocked: set[str] = set()
    real_open, real_read = builtins.open, Path.read_text

    def guarded_open(file, *args, **kwargs):
        if str(file) in blocked:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    def guarded_read(self, *args, **kwargs):
        if str(self) in blocked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(Path, "read_text", guarded_read)
    return blocked


def test_an_unreadable_gguf_or_config_is_one_line(good_gguf, good_hf, capsys, unreadable):
    unreadable.update({str(good_gguf), str(good_hf / "config.json")})
    for path in (good_gguf, good_hf):
        proc = bonsai_in_process(capsys, "info", str(path))
        assert_one_line_error(proc, "Permission denied")
        assert "internal error" not in proc.stderr and str(path) in proc.stderr


def test_the_good_files_still_load(good_gguf, good_hf, capsys):
    for path in (good_gguf, good_hf):
        proc = bonsai_in_process(capsys, "info", str(path))
        assert proc.returncode == 0, proc.stderr


# -- quantize into a place it cannot write -------------------------------------------------------------------
@pytest.fixture
def read_only_dir():
    import os
    import tempfile
    root = Path("/sys")  # read-only even for root (chmod does not stop root)
    try:
        fd, probe = tempfile.mkstemp(dir=root)
    except OSError:
        return root
    os.close(fd)
    os.remove(probe)
    pytest.skip("no read-only directory on this machine")


@pytest.mark.parametrize("where", ["out", "gguf"])
def test_quantize_into_a_read_only_place_fails_before_the_work(good_hf, files, capsys, read_only_dir, monkeypatch,
                                                                where):
    import engine.quantization.quantize

    def work(*args, **kwargs):
        raise AssertionError("the quantization ran before the output place was checked")

    monkeypatch.setattr(engine.quantization.quantize, "quantize", work)
    out = read_only_dir / "bonsai-out" if where == "out" else files / "q-out"
    extra = ["--gguf", str(read_only_dir / "bonsai.gguf")] if where == "gguf" else []
    proc = bonsai_in_process(capsys, "quantize", str(good_hf), str(out), "--group-size", "64", *extra)
    assert_one_line_error(proc, "is not writable")
    assert str(read_only_dir) in proc.stderr and "internal error" not in proc.stderr
