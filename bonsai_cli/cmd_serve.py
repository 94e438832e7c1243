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
    from engine.run.preflight import check_before_listening
    from engine.server.engine_thread import start_serving

    cfg = read_serve_config(config, {"server.host": host, "server.port": port, "server.api_key": api_key,
                                     "runtime.max_batch_size": slots, "runtime.device": device})
    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        raise BonsaiError(f"unknown --log-level '{log_level}': use debug, info, warning or error")
    architecture = architecture_of(cfg)
    check_before_listening(cfg, architecture)  # a bad config is one line here, before the port is bound
    sock = listening_socket(cfg.server.host, cfg.server.port)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        loopback = ipaddress.ip_address(cfg.server.host).is_loopback
    except ValueError:
        loopback = cfg.server.host == "localhost"
    if not loopback and cfg.server.api_key is None:
        err_console.print(f"[yellow]warning: listening on {cfg.server.host} without an API key: anyone who can "
                          "reach this address can use the server (set server.api_key or --api-key)[/yellow]")
    state = ServerState(cfg)
    app = create_app(state, functools.partial(start_serving, architecture=architecture))
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, log_level=log_level,
                                           timeout_graceful_shutdown=5, access_log=level <= logging.DEBUG))
    end_streams_first(server, state)
    state.on_load_error = lambda message: setattr(server, "should_exit", True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the handlers
    # that were there before: make that a normal exit, the shutdown being complete.
    # The handlers are put back afterwards: a caller in the same process (a test, an embedding
    # program) keeps its own.
    previous = {sig: signal.signal(sig, lambda signum, frame: sys.exit(0)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if state.load_error:
        raise BonsaiError(state.load_error)
    err_console.print("[dim]server stopped[/dim]")


def listening_socket(host: str, port: int):
    """The server's socket, bound here so that a port in use is the project's one line (uvicorn
    would log its start-up, then exit 3)."""
    import errno
    import socket

    from engine.errors import BonsaiError
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise BonsaiError(f"cannot listen on {host!r}: {e.strerror}; set server.host (or --host) to an address "
                          "of this machine") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise BonsaiError(f"port {port} on {host} is in use (another server?): stop it, or choose another "
                              "port with --port or server.port") from None
        raise BonsaiError(f"cannot listen on {host}:{port}: {e.strerror}; choose another server.host or "
                          "server.port") from None
    return sock


def end_streams_first(server, state) -> None:
    """On SIGINT/SIGTERM, first stop the engine, which ends every open stream with an error event
    (503, "the server is shutting down") and fails the waiting requests: uvicorn's graceful
    shutdown then finds them finished instead of cancelling them (a cut stream, two CancelledError
    tracebacks). The engine is stopped from a thread: the signal may have interrupted its lock."""
    import threading
    handle_exit = server.handle_exit

    def stop_then_exit(sig, frame) -> None:  # noqa: ANN001 - uvicorn's signal handler
        if state.served is not None:
            threading.Thread(target=state.served.thread.stop, name="bonsai-stop", daemon=True).start()
        handle_exit(sig, frame)

    server.handle_exit = stop_then_exit
