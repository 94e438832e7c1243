"""What speculation to run: the config dataclass, the CLI spec strings, and the drafter factory.

Spec strings (`--spec`): `ngram`, `draft:PATH` (or a pulled model's name, e.g. draft:qwen2.5-coder-0.5b),
`mtp` (a Qwen3.5 / Qwen3.6 checkpoint's own MTP head), `mtp:PATH` (a trained one), `dflash`, `dflash:PATH`, and
`mix:A,B,...` of those (in order of precedence), e.g. `mix:ngram,draft:./smollm2-int4`.

MTP and DFlash drafters live in `engine.speculative.mtp` / `engine.speculative.dflash` (the native
head in `engine.speculative.native_mtp`), imported only when asked for; each provides `load_mtp_drafter(path, target, *, max_seq_len)` /
`load_dflash_drafter(path, target, *, k, max_seq_len)` for a drafter file written by
`bonsai train-drafter`.
"""
from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.errors import BonsaiError
from engine.weights.loader import LoadedModel
from engine.speculative.drafter import Drafter

METHODS = ("ngram", "draft", "mtp", "dflash")
DRAFT_WEIGHTS = ("auto", "stored")  # a draft model's matrices on the CPU (engine.speculative.cpu_draft)
SPEC_HELP = "ngram | draft:PATH|NAME | mtp[:PATH] | dflash[:PATH] | mix:ngram,draft:PATH,..."


@dataclass(frozen=True)
class DrafterSpec:
    method: str
    path: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            near = difflib.get_close_matches(self.method, [*METHODS, "mix"], n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise BonsaiError(f"unknown drafter '{self.method}'{hint}: use {SPEC_HELP}")
        if self.method == "draft" and not self.path:
            raise BonsaiError("the draft drafter needs a model: draft:PATH or draft:NAME (a model sharing the "
                              "target's tokenizer)")
        if self.method == "ngram" and self.path:
            raise BonsaiError(f"the ngram drafter takes no path (got ngram:{self.path})")

    @property
    def label(self) -> str:
        return self.method if not self.path else f"{self.method}:{self.path}"


@dataclass(frozen=True)
class SpeculativeConfig:
    """drafters: one, or several mixed (in order of precedence); num_draft_tokens: k, the most
    tokens drafted per step; ngram_min / ngram_max: the n-gram sizes looked up; ngram_pool_size:
    entries of the n-gram pool shared across requests (0: none); adaptive: choose the drafter and
    the draft length per step from running acceptance and measured costs (off: always k tokens
    from the first drafter that has some, and no gate: every decode step speculates); draft_weights:
    a draft model's matrices on the CPU, "auto" (every one as 4-bit codes: engine.speculative.cpu_draft)
    or "stored" (as its file stores them, the output layer int8)."""
    drafters: tuple[DrafterSpec, ...]
    num_draft_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    ngram_pool_size: int = 0
    adaptive: bool = True
    draft_weights: str = "auto"

    def __post_init__(self) -> None:
        if not self.drafters:
            raise BonsaiError(f"speculation needs at least one drafter: {SPEC_HELP}")
        labels = [d.label for d in self.drafters]
        if len(set(labels)) != len(labels):
            raise BonsaiError(f"a drafter is listed twice in the mix ({', '.join(labels)})")
        if not 1 <= self.num_draft_tokens <= 64:
            raise BonsaiError(f"the number of draft tokens must be in 1..64, got {self.num_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 32:
            raise BonsaiError(f"n-gram sizes must satisfy 1 <= min <= max <= 32, got {self.ngram_min}..{self.ngram_max}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise BonsaiError(f"draft_weights must be auto (a draft model's matrices as 4-bit codes on the CPU) "
                              f"or stored (as its file stores them), got {self.draft_weights!r}")
        if self.ngram_pool_size < 0:
            raise BonsaiError(f"the n-gram pool size must be >= 0 (0: no pool), got {self.ngram_pool_size}")

    @property
    def method(self) -> str:
        """'ngram', 'draft', ... or 'mix:ngram,draft:PATH'."""
        if len(self.drafters) == 1:
            return self.drafters[0].method
        return "mix:" + ",".join(d.label for d in self.drafters)

    @staticmethod
    def from_spec(spec: str, **options: Any) -> "SpeculativeConfig":
        """A CLI spec string (see module doc) plus any other field."""
        return SpeculativeConfig(drafters=parse_spec(spec), **options)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "SpeculativeConfig":
        """From a config section: {'method': SPEC, 'num_draft_tokens': 4, ...}; unknown keys are
        errors naming the nearest valid key."""
        valid = ["method"] + [f.name for f in fields(SpeculativeConfig) if f.name != "drafters"]
        for key in data:
            if key not in valid:
                near = difflib.get_close_matches(str(key), valid, n=1)
                hint = f" (did you mean '{near[0]}'?)" if near else f" (valid: {', '.join(valid)})"
                raise BonsaiError(f"unknown speculative key '{key}'{hint}")
        if "method" not in data:
            raise BonsaiError(f"the speculative section needs 'method': {SPEC_HELP}")
        rest = {k: v for k, v in data.items() if k != "method"}
        return SpeculativeConfig.from_spec(str(data["method"]), **rest)


def parse_spec(spec: str) -> tuple[DrafterSpec, ...]:
    """'ngram' | 'draft:PATH' | 'mtp[:PATH]' | 'dflash[:PATH]' | 'mix:A,B,...' → drafter specs."""
    spec = spec.strip()
    if spec == "mix" or spec.startswith("mix:"):
        items = [s.strip() for s in spec[4:].split(",") if s.strip()]
        if not items:
            raise BonsaiError(f"mix needs a list of drafters, e.g. mix:ngram,draft:PATH ({SPEC_HELP})")
        if any(s == "mix" or s.startswith("mix:") for s in items):
            raise BonsaiError("a mix cannot contain another mix: list its drafters directly")
        return tuple(_one(s) for s in items)
    if not spec:
        raise BonsaiError(f"empty --spec: use {SPEC_HELP}")
    return (_one(spec),)


def _one(text: str) -> DrafterSpec:
    method, sep, path = text.partition(":")
    return DrafterSpec(method.strip(), path.strip() if sep else None)


def build_drafter(config: SpeculativeConfig, target: LoadedModel, max_seq_len: int,
                  ngram_pool: Any | None = None, loaded_drafts: dict[str, Any] | None = None) -> Drafter:
    """The drafter the config describes, for `target` (whose tokenizer a draft model must share).
    max_seq_len: the target's context (a draft model's cache is sized for it plus k). ngram_pool:
    a pool shared with other requests (a server passes its own); by default one of
    config.ngram_pool_size entries, or none. loaded_drafts: draft models already loaded, by path
    (filled here; also MTP / DFlash modules, by their spec label): a server's slots share one draft
    model's or drafter's weights, each with its own KV cache."""
    from engine.speculative.mix import MixDrafter
    from engine.speculative.ngram import NgramPool
    if ngram_pool is None and config.ngram_pool_size:
        ngram_pool = NgramPool(config.ngram_pool_size)
    members = [_build_one(spec, config, target, max_seq_len, ngram_pool, loaded_drafts) for spec in config.drafters]
    for spec, member in zip(config.drafters, members):
        prepare = getattr(member, "prepare", None)  # graphs a drafter replays, captured before any request
        if prepare is not None:
            prepare(config.num_draft_tokens)
        limit = getattr(member, "max_draft_tokens", None)
        if limit is not None and config.num_draft_tokens > limit:
            raise BonsaiError(f"{config.num_draft_tokens} draft tokens asked for, but the {spec.method} drafter "
                              f"drafts at most {limit} (its block size): use --draft-tokens {limit} or less")
    if len(members) == 1 and not config.adaptive:
        return members[0]
    return MixDrafter(members, adaptive=config.adaptive)


def build_drafters(config: SpeculativeConfig, target: LoadedModel, max_seq_len: int, count: int) -> list[Drafter]:
    """One drafter per slot: an n-gram pool (config.ngram_pool_size) shared by all, a draft model
    loaded once (each drafter has its own KV cache)."""
    from engine.speculative.ngram import NgramPool
    pool = NgramPool(config.ngram_pool_size) if config.ngram_pool_size else None
    drafts: dict[str, Any] = {}
    return [build_drafter(config, target, max_seq_len, ngram_pool=pool, loaded_drafts=drafts) for _ in range(count)]


def _build_one(spec: DrafterSpec, config: SpeculativeConfig, target: LoadedModel, max_seq_len: int,
               ngram_pool: Any | None, loaded_drafts: dict[str, Any] | None) -> Drafter:
    if spec.method == "ngram":
        from engine.speculative.ngram import NgramDrafter
        return NgramDrafter(config.ngram_min, config.ngram_max, ngram_pool)
    if spec.method == "draft":
        return _draft_model(spec.path, target, max_seq_len + config.num_draft_tokens + 1,
                            {} if loaded_drafts is None else loaded_drafts, config.draft_weights)
    if spec.method == "mtp" and not spec.path:  # the checkpoint's own head: weights loaded once, shared by slots
        from engine.speculative.native_mtp import load_native_mtp_drafter
        shared = {} if loaded_drafts is None else loaded_drafts
        drafter = load_native_mtp_drafter(target, max_seq_len=max_seq_len + config.num_draft_tokens + 1,
                                          module=shared.get(spec.label))
        shared[spec.label] = drafter.module
        return drafter
    if not spec.path:
        raise BonsaiError(f"the {spec.method} drafter needs its file: {spec.method}:PATH (train one with "
                          f"`bonsai train-drafter MODEL --kind {spec.method} --out DIR`)")
    if not Path(spec.path).expanduser().exists():
        raise BonsaiError(f"{spec.method} drafter file not found: {spec.path}")
    try:
        module = importlib.import_module(f"engine.speculative.{spec.method}")
    except ModuleNotFoundError as e:
        if e.name != f"engine.speculative.{spec.method}":
            raise
        raise BonsaiError(f"the {spec.method} drafter is not part of this bonsai build "
                          f"(engine/speculative/{spec.method}.py is missing): use ngram or draft:PATH") from None
    shared = {} if loaded_drafts is None else loaded_drafts  # the slots share one module's weights
    options = {"max_seq_len": max_seq_len + config.num_draft_tokens + 1, "module": shared.get(spec.label)}
    if spec.method == "dflash":
        options["k"] = config.num_draft_tokens  # refused in one line above its block size
    drafter = getattr(module, f"load_{spec.method}_drafter")(spec.path, target, **options)
    shared[spec.label] = drafter.module
    return drafter


def _draft_model(path: str, target: LoadedModel, max_seq_len: int, loaded_drafts: dict[str, LoadedModel],
                 weights: str = "auto") -> Drafter:
    from engine.weights.loader import load_model
    from engine.speculative.cpu_draft import four_bit_drafter
    from engine.speculative.draft_model import (DraftModelDrafter, check_same_tokenizer, narrow_output_layer,
                                                resolve_draft_model)
    loaded = loaded_drafts.get(path)
    if loaded is None:
        loaded = load_model(resolve_draft_model(path), device=target.device, dtype=target.dtype,
                            cpu_int4=target.cpu_int4, cpu_kernels=target.cpu_kernels or "auto")
        check_same_tokenizer(loaded.tokenizer, target.tokenizer, path)
        if weights == "stored" or not four_bit_drafter(loaded):
            narrow_output_layer(loaded)
        loaded_drafts[path] = loaded
    return DraftModelDrafter(loaded, target.config.vocab_size, max_seq_len)
