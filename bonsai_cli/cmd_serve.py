"""`bonsai serve --config serve.yaml`: the OpenAI-compatible server (the only place its YAML is read)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from bonsai_cli.common import err_console


def read_serve_config(path: Path, overrides: dict[str, Any] | None = None):
    """The YAML file as a validated ServeConfig, with `section.key` overrides from the command line."""
    from bonsai_cli.run_options import read_config_file
    from engine.server.config import ServeConfig
    return ServeConfig.from_dict(read_config_file(path, overrides))


def serve(
    config: Path = typer.Option(..., "--config", "-c", help="serve.yaml (see configs/serve-*.yaml)"),
    host: Optional[str] = typer.Option(None, "--host", help="address to bind (default 127.0.0.1)"),
    port: Optional[int] = typer.Option(None, "--port", help="port (default 8080; 0 picks a free one)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="BONSAI_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on every route but /health"),
    slots: Optional[int] = typer.Option(None, "--slots", help="runtime.max_batch_size: requests decoded together"),
    device: Optional[str] = typer.Option(None, "--device", help="runtime.device: cpu or cuda[:N]"),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error"),
) -> None:
    """Serve a model over the OpenAI API (chat/completions, completions, models) with slots,
    prompt-cache reuse, batched decoding, /health, /metrics and /slots."""
    import functools
    import ipaddress
    import logging
    import signal
    import sys

    import uvicorn

    from engine.errors import BonsaiError
    from bonsai_cli.run_options import architecture_of
    from engine.server.api import ServerState, create_app
    from engine.server.engine_thread import start_serving

    cfg = read_serve_config(config, {"server.host": host, "server.port": port, "server.api_key": api_key,
                                     "runtime.max_batch_size": slots, "runtime.device": device})
    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        raise BonsaiError(f"unknown --log-level '{log_level}': use debug, info, warning or error")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        loopback = ipaddress.ip_address(cfg.server.host).is_loopback
    except ValueError:
        loopback = cfg.server.host == "localhost"
    if not loopback and cfg.server.api_key is None:
        err_console.print(f"[yellow]warning: listening on {cfg.server.host} without an API key: anyone who can "
                          "reach this address can use the server (set server.api_key or --api-key)[/yellow]")
    state = ServerState(cfg)
    architecture = architecture_of(cfg)
    app = create_app(state, functools.partial(start_serving, architecture=architecture))
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level=log_level,
                                           timeout_graceful_shutdown=5, access_log=level <= logging.DEBUG))
    state.on_load_error = lambda message: setattr(server, "should_exit", True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the handlers
    # that were there before: make that a normal exit, the shutdown being complete.
    # The handlers are put back afterwards: a caller in the same process (a test, an embedding
    # program) keeps its own.
    previous = {sig: signal.signal(sig, lambda signum, frame: sys.exit(0)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if state.load_error:
        raise BonsaiError(state.load_error)
    err_console.print("[dim]server stopped[/dim]")
