"""The HTTP side: the app, its guard (API key, loading, errors), /health, /metrics, /slots, and the
routes of each protocol (openai_api.py, anthropic_api.py, responses_api.py, extras.py).

The model loads in a background thread after the server starts listening; until it is ready every
route but /health answers 503 and /health reports the stage. Requests are validated strictly
(protocol.py), turned into prompt ids, and handed to the engine loop; its events come back through
an asyncio queue per request (relay.py: one loop wake-up for all the events of a decode step). A
client that disconnects cancels its request, which frees the slot at the engine's next iteration.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.decoding.metrics import Metrics
from engine.errors import BonsaiError
from engine.server import anthropic_api, extras, openai_api, responses_api
from engine.server import protocol as P
from engine.server.config import ServeConfig
from engine.server.engine_thread import Served
from engine.server.serving import error as _error

log = logging.getLogger("bonsai.server")


@dataclass
class ServerState:
    config: ServeConfig
    metrics: Metrics = field(default_factory=Metrics)
    stage: str = "starting"
    progress: float = 0.0
    served: Served | None = None
    load_error: str | None = None
    on_load_error: Callable[[str], None] = lambda message: None

    def load(self, loader: Callable[..., Served]) -> None:
        def progress(stage: str, fraction: float) -> None:
            self.stage, self.progress = stage, fraction
            log.info("loading: %s", stage)
        try:
            self.served = loader(self.config, self.metrics, progress)
        except BaseException as e:  # noqa: BLE001 - reported to the command, which exits 1
            self.load_error = str(e).splitlines()[0] if isinstance(e, BonsaiError) else f"{type(e).__name__}: {e}"
            log.error("loading failed: %s", self.load_error)
            self.on_load_error(self.load_error)


def create_app(state: ServerState, loader: Callable[..., Served] | None = None) -> FastAPI:
    cfg = state.config
    key = cfg.server.api_key

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if loader is not None:
            threading.Thread(target=state.load, args=(loader,), name="bonsai-load", daemon=True).start()
        yield
        if state.served is not None:  # shutdown: running requests end with a 503 event, the engine stops
            await asyncio.get_running_loop().run_in_executor(None, state.served.stop)

    app = FastAPI(title="bonsai", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    relays: dict = {}  # the server's loop → its EventRelay (serving.Generation)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if path != "/health":
            if key is not None and not _authorized(request, key):
                return _shaped(path, _error(401, "invalid or missing API key: send 'Authorization: Bearer KEY' "
                                            "(or 'x-api-key: KEY')", "authentication_error", code="invalid_api_key"))
            if state.served is None:
                return _shaped(path, _loading_response(state))
        try:
            return await call_next(request)
        except Exception as e:  # noqa: BLE001 - one failing request never takes the server down
            log.exception("request %s failed", path)
            return _shaped(path, _error(500, f"internal error: {type(e).__name__}", "server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)

    @app.get("/health")
    async def health():
        if state.served is None:
            return _loading_response(state)
        if not state.served.alive:  # stopped by a failure, or shutting down: truthfully not serving
            return _error(503, state.served.engine.failure or "the server is shutting down", "unavailable_error",
                          code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [extras.model_card(state.served)]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/slots")
    async def slots():
        return state.served.engine.slots()

    openai_api.add_routes(app, state, relays)
    anthropic_api.add_routes(app, state, relays)
    responses_api.add_routes(app, state, relays)
    extras.add_routes(app, state)
    return app


def _authorized(request: Request, key: str) -> bool:
    bearer = request.headers.get("authorization", "")
    given = request.headers.get("x-api-key")
    return hmac.compare_digest(bearer.encode(), f"Bearer {key}".encode()) or (
        given is not None and hmac.compare_digest(given.encode(), key.encode()))


def _shaped(path: str, response: Response) -> Response:
    """An error of /v1/messages in Anthropic's shape; every other response as it is."""
    if path.startswith("/v1/messages") and isinstance(response, JSONResponse) and response.status_code >= 400:
        return anthropic_api.anthropic_error(response)
    return response


def _loading_response(state: ServerState) -> JSONResponse:
    if state.load_error:
        return _error(500, f"the model failed to load: {state.load_error}", "server_error")
    body = P.error_body("Loading model", "unavailable_error", code=503)
    body["error"]["code"] = 503
    body["progress"], body["stage"] = round(state.progress, 3), state.stage
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})
