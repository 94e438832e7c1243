"""The endpoints tools probe: llama.cpp's /props, /tokenize, /detokenize; /v1/models/{id}; and
/v1/embeddings, which this server does not offer (a clear 404 instead of a bare one)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from engine.errors import BonsaiError
from engine.server import protocol as P
from engine.server.engine_thread import Served
from engine.server.serving import error, from_exception, read_json
from engine.server.tools import detect_family

MAX_IDS = 1 << 20


class TokenizeBody(BaseModel):
    model_config = P.STRICT
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeBody(BaseModel):
    model_config = P.STRICT
    tokens: list[int] = Field(max_length=MAX_IDS)


def model_card(served: Served) -> dict[str, Any]:
    return {"id": served.model_id, "object": "model", "created": 0, "owned_by": "bonsai",
            "meta": {"n_ctx_slot": served.engine.slot_context, "slots": len(served.engine.runner.cache.slots)}}


def add_routes(app: FastAPI, state: Any) -> None:
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        card = model_card(state.served)
        if model_id != card["id"]:
            return error(404, f"model '{model_id}' is not served here; this server serves '{card['id']}'",
                         "not_found_error", "model", "model_not_found")
        return card

    @app.get("/props")
    async def props():
        served = state.served
        tok = served.engine.tokenizer
        return {"model_alias": served.model_id, "model_path": str(served.config.model.path),
                "total_slots": len(served.engine.runner.cache.slots), "n_ctx": served.engine.slot_context,
                "chat_template": tok.chat_template or "", "tool_call_format": detect_family(tok.chat_template),
                "bos_token": tok.special_tokens_map.get("bos_token"), "eos_token": tok.special_tokens_map.get("eos_token"),
                "default_generation_settings": {"n_ctx": served.engine.slot_context,
                                                "n_predict": served.config.server.default_max_tokens},
                "modalities": {"vision": False, "audio": False}, "build_info": "bonsai"}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            body = P.parse(TokenizeBody, await read_json(request, state.config.server.max_body_bytes))
            _check_chars(len(body.content), state.config.server.max_prompt_chars)
        except BonsaiError as e:
            return from_exception(e)
        tok = state.served.engine.tokenizer
        ids = tok.encode(body.content, add_special_tokens=body.add_special)
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = P.parse(DetokenizeBody, await read_json(request, state.config.server.max_body_bytes))
            vocab = state.served.engine.tokenizer.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise P.RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
        except BonsaiError as e:
            return from_exception(e)
        return {"content": state.served.engine.tokenizer.decode(body.tokens)}

    @app.post("/v1/embeddings")
    async def embeddings():
        return error(404, "/v1/embeddings is not offered: this server generates text only (no pooled embeddings); "
                     "use an embedding model's server for embeddings", "not_found_error", code="not_offered")


def _check_chars(n: int, limit: int) -> None:
    if n > limit:
        raise P.RequestError(f"the text has {n} characters, more than the {limit} this server takes", "content")


