"""The `bonsai` command: Typer app, one-line errors, --debug for tracebacks."""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import click
import typer

from bonsai_cli import cmd_bench, cmd_chat, cmd_eval, cmd_generate, cmd_info, cmd_pull, cmd_quantize, cmd_serve
from bonsai_cli import cmd_train_drafter

# Typer 0.29+ vendors its own click: accept both its exception classes and click's.
_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_USAGE = (click.ClickException, getattr(typer, "TyperException", click.ClickException))

app = typer.Typer(
    name="bonsai", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Run extremely compressed LLMs (ternary, 1-bit, int4) fast on one GPU — or on the CPU. "
         "Errors are one line; add --debug anywhere to see the traceback.")
app.command("pull")(cmd_pull.pull)
app.command("info")(cmd_info.info)
app.command("generate")(cmd_generate.generate)
app.command("chat")(cmd_chat.chat)
app.command("bench")(cmd_bench.bench)
app.command("eval")(cmd_eval.eval_command)
app.command("quantize")(cmd_quantize.quantize)
app.command("serve")(cmd_serve.serve)
app.command("train-drafter")(cmd_train_drafter.train_drafter)


# `bonsai quantize` allocates and frees the same large temporaries for its whole run (GPTQ, block tuning): with glibc
# asked for transparent huge pages (a tunable read at process start) its page faults cost much less system time at
# the same peak (docs/quality.md, session 26). Set for that command only, by running the process again.
HUGE_PAGES = "glibc.malloc.hugetlb=1"
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def with_huge_pages(args: list[str]) -> None:
    """Run this process again (same command line) with glibc's huge-page tunable added to GLIBC_TUNABLES when it runs
    `quantize` and the tunable is not set yet, on Linux with glibc and transparent huge pages not off; else nothing."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if not args or args[0] != "quantize" or "glibc.malloc.hugetlb" in tunables or not sys.platform.startswith("linux"):
        return
    try:
        if platform.libc_ver()[0] != "glibc" or "[never]" in THP_MODE.read_text():
            return
    except OSError:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, dict(os.environ, GLIBC_TUNABLES=":".join(filter(None, (tunables, HUGE_PAGES)))))


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app; user errors print one line on stderr and exit 1."""
    from engine.errors import BonsaiError, one_line

    if argv is None:  # a process of its own (never a caller's: tests call main(argv) in theirs)
        with_huge_pages(sys.argv[1:])
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if debug:
        args.remove("--debug")
    try:
        code = app(args=args, prog_name="bonsai", standalone_mode=False)
        if isinstance(code, int) and code:  # typer.Exit(n) comes back as a return value here
            sys.exit(code)
    except _EXIT as e:
        sys.exit(getattr(e, "exit_code", 0))
    except _ABORT:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except _USAGE as e:
        if debug:
            raise
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        print(f"error: {one_line(message)} (see `bonsai --help`)", file=sys.stderr)
        sys.exit(1)
    except BonsaiError as e:
        if debug:
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # an internal error: still one line unless --debug
        if debug:
            raise
        print(f"internal error: {type(e).__name__}: {one_line(str(e).splitlines()[0]) if str(e) else ''} "
              "(run again with --debug for the traceback)", file=sys.stderr)
        sys.exit(1)
