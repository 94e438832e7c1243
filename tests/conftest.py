"""Shared fixtures: the real SmolLM2 GGUF (pulled once into the store) and a tiny random model."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter (set before anything imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.sources import store  # noqa: E402


def _smollm2_path() -> Path:
    override = os.environ.get("BONSAI_SMOLLM2_GGUF")
    if override:
        return Path(override)
    found = store.find_pulled(store.DEFAULT_MODEL)
    if found is not None:
        return found
    return store.pull(store.DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (pulled into $BONSAI_HOME on first use)."""
    return _smollm2_path()


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present (never in CI)."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf):
    """SmolLM2 loaded the default CPU way (float16 matrices, float32 activations), once per session:
    tests build their own runners on it and must not change the model."""
    from engine.weights.loader import load_model
    return load_model(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_loaded_f32(smollm2_gguf):
    """SmolLM2 with float32 matrices (exact several-row products), once per session; read-only."""
    from engine.weights.loader import load_model
    return load_model(smollm2_gguf, "cpu", weight_dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_gguf):
    """Our tokenizer built from the SmolLM2 GGUF's metadata."""
    from engine.sources.gguf_file import GGUFFile
    from engine.sources.tokenizer import Tokenizer
    return Tokenizer.from_gguf_metadata(GGUFFile(smollm2_gguf).metadata)


@pytest.fixture(scope="session")
def tiny_engine_model(smollm2_tok):
    """A tiny random llama (hidden 32, 2 layers) over SmolLM2's vocabulary, for the server's tests
    that need an engine but not a real model; read-only (each engine makes its own runner)."""
    from tests.test_serve_engine import tiny_loaded
    return tiny_loaded(smollm2_tok.vocab_size)


@pytest.fixture(scope="session")
def smollm2_hf_tok(smollm2_gguf):
    """transformers' tokenizer for the same GGUF: the reference."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture
def one_thread():
    """Small tensors: extra threads only add overhead (and stall on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(scope="session", autouse=True)
def default_sigint():
    """A suite started as a background job of a script (`pytest ... &`) inherits an ignored SIGINT
    (POSIX: asynchronous commands of a non-interactive shell ignore it), and so would every child
    process the tests start: the tests run with Python's own SIGINT handling, however launched."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(autouse=True)
def signal_handlers_kept(default_sigint):
    """Every test (and the code it runs in this process) leaves SIGINT and SIGTERM as it found
    them: a handler left behind changes how later tests, and the children they start, stop."""
    before = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    yield
    changed = {sig: handler for sig in _SIGNALS if (handler := signal.getsignal(sig)) != before[sig]}
    for sig in changed:
        signal.signal(sig, before[sig])
    assert not changed, "the test left signal handlers changed: " + ", ".join(
        f"{signal.Signals(sig).name} {before[sig]!r} -> {handler!r}" for sig, handler in changed.items())
