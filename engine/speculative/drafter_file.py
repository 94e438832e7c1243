"""The drafter checkpoint: one safetensors file with self-describing metadata.

Metadata (all strings): format = "bonsai-drafter", version, kind ("mtp" | "dflash"), config (the
DrafterConfig as JSON), target (the identity of the model it was trained for: hidden size,
vocabulary size, layer count, a hash of the tokenizer's vocabulary) and step (training steps).
Loading checks the identity against the target at hand and refuses another model in one line.
A path may name the file or the directory holding `drafter.safetensors`.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.errors import BonsaiError
from engine.speculative.draft_layers import DrafterConfig

FORMAT = "bonsai-drafter"
VERSION = 1
FILE_NAME = "drafter.safetensors"


@dataclass(frozen=True)
class TargetIdentity:
    hidden_size: int
    vocab_size: int
    num_layers: int
    tokenizer_hash: str  # sha256 of the vocabulary (id → token string), "none" without a tokenizer

    @staticmethod
    def of(loaded) -> "TargetIdentity":
        cfg = loaded.config
        return TargetIdentity(cfg.hidden_size, cfg.vocab_size, cfg.num_layers, tokenizer_hash(loaded.tokenizer))

    def mismatch(self, other: "TargetIdentity") -> str | None:
        """What differs from `other` (the model at hand), or None."""
        for name in ("hidden_size", "vocab_size", "num_layers"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} {getattr(self, name)} (this model has {getattr(other, name)})"
        if self.tokenizer_hash != other.tokenizer_hash:
            return "a different tokenizer vocabulary"
        return None


def tokenizer_hash(tokenizer) -> str:
    if tokenizer is None:
        return "none"
    digest = hashlib.sha256()
    for i in range(tokenizer.vocab_size):
        digest.update(f"{i}\t{tokenizer.id_to_token(i)}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:32]


@dataclass
class DrafterFile:
    config: DrafterConfig
    target: TargetIdentity
    tensors: dict[str, torch.Tensor]
    step: int = 0


def resolve_path(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        path = path / FILE_NAME
    if not path.exists():
        raise BonsaiError(f"drafter file not found: {path} (train one with `bonsai train-drafter MODEL --out DIR`)")
    return path


def atomic_write(path: Path, write) -> None:
    """write(tmp_path) then rename onto path: readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_drafter(path: str | Path, config: DrafterConfig, target: TargetIdentity,
                 state: dict[str, torch.Tensor], step: int = 0) -> Path:
    from safetensors.torch import save_file
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / FILE_NAME
    metadata = {"format": FORMAT, "version": str(VERSION), "kind": config.kind,
                "config": json.dumps(config.to_dict()), "target": json.dumps(asdict(target)), "step": str(step)}
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return path


def read_drafter(path: str | Path, expected_kind: str | None = None, target: TargetIdentity | None = None
                 ) -> DrafterFile:
    """Read and check a drafter file: its format, kind, and that it was trained for `target`."""
    from safetensors import SafetensorError, safe_open
    path = resolve_path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise BonsaiError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0]})") from None
    if meta.get("format") != FORMAT:
        raise BonsaiError(f"{path} is not a bonsai drafter (its metadata has no format '{FORMAT}')")
    if int(meta.get("version", "0")) > VERSION:
        raise BonsaiError(f"{path} is drafter format version {meta['version']}; this bonsai reads up to "
                          f"{VERSION}: upgrade bonsai")
    kind = meta.get("kind")
    if expected_kind is not None and kind != expected_kind:
        raise BonsaiError(f"{path} is a '{kind}' drafter, not '{expected_kind}': use --spec {kind}:{path}")
    config = DrafterConfig.from_dict(json.loads(meta["config"]))
    identity = TargetIdentity(**json.loads(meta["target"]))
    if target is not None:
        diff = identity.mismatch(target)
        if diff is not None:
            raise BonsaiError(f"{path} was trained for another model ({diff}): train a drafter for this "
                              "model with `bonsai train-drafter`")
    return DrafterFile(config, identity, tensors, int(meta.get("step", "0")))
