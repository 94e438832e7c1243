"""Quality of a model against a reference: perplexity, KL divergence, same top token.

Both models read the same token ids in non-overlapping windows of `context` tokens; every position
but the first of a window is scored. KL is KL(reference ‖ model) of the next-token distributions.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from engine.errors import BonsaiError
from engine.runtime.runner import ModelRunner


@dataclass
class EvalResult:
    tokens: int  # positions scored
    perplexity: float
    reference_perplexity: float
    kl_mean: float
    kl_p99: float
    kl_max: float
    same_top: float  # fraction of positions where both models' most likely token agree

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def default_eval_text() -> str:
    """English prose present in every Python install: the pydoc topic help texts."""
    from pydoc_data import topics
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


CALIB_MODULES = ("collections", "argparse", "email.message", "json", "http.client", "http.server", "logging",
                 "pathlib", "itertools", "functools", "typing", "subprocess", "threading", "asyncio.tasks",
                 "datetime", "decimal", "fractions", "statistics", "textwrap", "string", "re", "shutil",
                 "tarfile", "zipfile", "csv", "sqlite3", "unittest.case", "doctest", "inspect", "dataclasses",
                 "enum", "contextlib", "heapq", "bisect", "random", "urllib.parse", "urllib.request",
                 "xml.etree.ElementTree", "configparser", "socket", "ssl", "selectors", "queue", "sched",
                 "tempfile", "glob", "fnmatch", "difflib", "pprint", "pickle", "copy", "weakref", "abc",
                 "numbers", "operator", "io", "codecs", "locale", "gettext", "calendar", "zoneinfo", "uuid",
                 "hashlib", "hmac", "secrets", "base64", "binascii", "struct", "array", "mmap", "signal",
                 "multiprocessing.pool", "concurrent.futures", "traceback", "warnings", "timeit", "trace",
                 "tokenize", "ast", "dis", "importlib", "zipimport", "platform", "sysconfig", "smtplib",
                 "imaplib", "ftplib", "mailbox", "mimetypes", "html.parser", "webbrowser", "wave", "colorsys",
                 "shlex", "getpass", "curses", "tkinter", "turtle", "cmd", "code", "pdb", "profile", "pstats")


def default_calibration_text() -> str:
    """Docstrings of standard-library modules and their public members (pydoc_data excluded): the default
    calibration text of `bonsai quantize` and of every measurement in docs/quality-methods.md (about
    180k tokens with SmolLM2's tokenizer; never the evaluation text)."""
    import importlib
    import inspect
    seen, parts = set(), []

    def add(obj) -> None:
        doc = inspect.getdoc(obj)
        if doc and len(doc) > 80 and doc not in seen:
            seen.add(doc)
            parts.append(doc)

    for name in CALIB_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # a module this Python lacks (tkinter, curses): skip it
            continue
        add(module)
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            add(obj)
            if inspect.isclass(obj):
                for meth in sorted(vars(obj)):
                    if not meth.startswith("_"):
                        add(getattr(obj, meth, None))
    return "\n\n".join(parts)


def read_eval_text(path: Path | None) -> str:
    if path is None:
        return default_eval_text()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BonsaiError(f"evaluation text not found: {path}") from None
    except UnicodeDecodeError:
        raise BonsaiError(f"{path} is not UTF-8 text") from None
    if not text.strip():
        raise BonsaiError(f"{path} is empty: give a text file with prose to score")
    return text


def check_same_tokenizer(model: ModelRunner, reference: ModelRunner, sample: str) -> None:
    a, b = model.loaded.tokenizer, reference.loaded.tokenizer
    if model.loaded.config.vocab_size != reference.loaded.config.vocab_size or a.encode(sample) != b.encode(sample):
        raise BonsaiError("the model and the reference do not share a tokenizer: KL and same-top need "
                          "the same vocabulary (compare a quantized model with its own source)")


@torch.inference_mode()
def window_logprobs(runner: ModelRunner, window: list[int]) -> torch.Tensor:
    """Teacher-forced next-token log-probabilities of a fresh sequence: [len(window) - 1, V] float32."""
    runner.slot().reset()
    logits = runner.forward(runner.slot(), window, num_logits=None)[:-1]  # [L-1, V]
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class Tally:
    """Per-position scores of a model against a reference, accumulated window by window."""
    nll: list[torch.Tensor] = field(default_factory=list)
    ref_nll: list[torch.Tensor] = field(default_factory=list)
    kls: list[torch.Tensor] = field(default_factory=list)
    same: int = 0

    def add(self, logp: torch.Tensor, ref_logp: torch.Tensor, targets: torch.Tensor) -> None:
        """logp, ref_logp [L-1, V] on one device; targets [L-1] the tokens that followed."""
        self.nll.append(-logp.gather(-1, targets[:, None]).squeeze(-1).cpu())
        self.ref_nll.append(-ref_logp.gather(-1, targets[:, None]).squeeze(-1).cpu())
        self.kls.append((ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0).cpu())
        self.same += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())

    def result(self) -> EvalResult:
        nll_all, ref_all, kl_all = torch.cat(self.nll), torch.cat(self.ref_nll), torch.cat(self.kls)
        return EvalResult(tokens=int(nll_all.numel()), perplexity=math.exp(float(nll_all.mean())),
                          reference_perplexity=math.exp(float(ref_all.mean())), kl_mean=float(kl_all.mean()),
                          kl_p99=float(torch.quantile(kl_all.double(), 0.99)), kl_max=float(kl_all.max()),
                          same_top=self.same / nll_all.numel())


def windows_of(token_ids: list[int], context: int) -> list[list[int]]:
    """Non-overlapping windows of `context` tokens (the last may be shorter; none shorter than 2)."""
    windows = [token_ids[i:i + context] for i in range(0, len(token_ids) - 1, context)]
    return [w for w in windows if len(w) >= 2]


@torch.inference_mode()
def evaluate(model: ModelRunner, reference: ModelRunner, token_ids: list[int], context: int,
             on_window: Callable[[int, int], None] = lambda done, total: None) -> EvalResult:
    if context < 2:
        raise BonsaiError("--context must be at least 2 tokens")
    if context > min(model.max_seq_len, reference.max_seq_len):
        raise BonsaiError(f"--context {context} is longer than the allocated context")
    windows = windows_of(token_ids, context)
    if not windows:
        raise BonsaiError("the evaluation text is too short: it needs at least 2 tokens")
    tally = Tally()
    for i, window in enumerate(windows):
        targets = torch.tensor(window[1:], device=model.device)  # [L-1]
        logp = window_logprobs(model, window)
        tally.add(logp, window_logprobs(reference, window).to(model.device), targets)
        on_window(i + 1, len(windows))
    return tally.result()
