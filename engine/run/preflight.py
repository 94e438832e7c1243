"""What a run config is checked for from files' headers alone (no weights): the devices, the model
(found, readable, a model: its header, architecture and tensor inventory, engine.sources.model_check),
its tokenizer, the context against its positions, the chat template, the drafters' files and the
memory plan. `bonsai serve` runs `check_before_listening` before it binds its port, so a bad config
is one line and exit 1, never a server that starts listening, logs its start-up and only then fails
in its loading thread; open_run (engine.run.builder) uses the same checks of the context, the chat
template and a generated model's tokenizer."""
from __future__ import annotations

from pathlib import Path

from engine.errors import BonsaiError, GroupSizeError
from engine.memory.budget import SERVE_KEYS, check_budget
from engine.run.config import RunConfig
from engine.run.plan import RunPlan, plan_run
from engine.sources import store
from engine.sources.model_config import ModelConfig
from engine.sources.tokenizer import Tokenizer
from engine.weights.loader import open_model_source, resolve_device


def check_before_listening(config: RunConfig, architecture: ModelConfig | None = None) -> None:
    """architecture: with model.load_format dummy, the ModelConfig of its YAML (the command reads it)."""
    m = config.model
    for device in config.runtime.devices:
        resolve_device(device)
    if m.load_format == "dummy":
        model_config = architecture
        check_dummy_tokenizer(config, architecture, open_model_source(store.resolve_model(m.tokenizer)).tokenizer())
    else:
        source = open_model_source(store.resolve_model(m.path))
        model_config = source.model_config()
        source.tokenizer()
    check_context(config, model_config)
    chat_template(config)
    for drafter in (config.spec_config.drafters if config.spec_config is not None else ()):
        if drafter.method == "draft":
            try:
                draft = open_model_source(store.resolve_model(drafter.path))
                draft.model_config()
                draft.tokenizer()
            except BonsaiError as e:
                raise BonsaiError(f"draft model: {e}") from None
        elif drafter.path and not Path(drafter.path).expanduser().exists():
            raise BonsaiError(f"{drafter.method} drafter file not found: {drafter.path}")
    plan(config, architecture)


def check_dummy_tokenizer(config: RunConfig, architecture: ModelConfig, tokenizer: Tokenizer) -> None:
    """With load_format dummy: model.tokenizer's ids must fit the generated model's vocabulary."""
    if tokenizer.vocab_size > architecture.vocab_size:
        raise BonsaiError(f"config model.tokenizer: its {tokenizer.vocab_size} tokens do not fit the "
                          f"{architecture.vocab_size}-token vocabulary of {Path(config.model.path).name}; use a "
                          "smaller tokenizer")


def check_context(config: RunConfig, model_config: ModelConfig) -> None:
    """runtime.max_seq_len (KV positions per slot) within the model's positions."""
    limit = model_config.max_position_embeddings
    seq_len = config.contexts(limit)[1]
    if seq_len > limit:
        raise BonsaiError(f"config runtime.max_seq_len {seq_len} exceeds the model's {limit} positions; "
                          f"lower it to {limit} or less")


def chat_template(config: RunConfig) -> str | None:
    """The text of model.chat_template (None: the model's own template)."""
    if not config.model.chat_template:
        return None
    template = Path(config.model.chat_template).expanduser()
    try:
        return template.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = "no such file" if isinstance(e, FileNotFoundError) else getattr(e, "strerror", None) or str(e)
        raise BonsaiError(f"config model.chat_template: cannot read {template} ({reason}); give a UTF-8 .jinja "
                          "file") from None


def plan(config: RunConfig, architecture: ModelConfig | None = None) -> RunPlan:
    """The memory plan (engine.run.plan), refused when over memory.max_gpu_memory (a pipeline's
    stages are checked when it is split); a group size the matrices cannot be packed in names
    model.group_size."""
    try:
        planned = plan_run(config, architecture)
        if not config.memory.pipeline_parallel:
            check_budget(planned.plan, planned.limit, planned.weights, planned.settings, SERVE_KEYS,
                         drafter=planned.drafter)
        return planned
    except GroupSizeError as e:
        raise e.for_setting("config model.group_size") from None
