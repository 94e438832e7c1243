"""Shared fixtures: the real SmolLM2 GGUF (pulled once into the store) and a tiny random model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import store


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
