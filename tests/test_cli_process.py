"""What the `bonsai` process does to itself before a command runs: `quantize` runs again with glibc's huge-page
tunable (bonsai_cli.main.with_huge_pages), once, keeping the caller's other tunables; no other command does."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bonsai_cli import main as cli


@pytest.fixture
def reruns(monkeypatch, tmp_path) -> list:
    """The execve calls with_huge_pages makes (captured, not made), on a Linux glibc with THP on "madvise"."""
    calls: list = []
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.setattr(cli.sys, "platform", "linux")
    monkeypatch.setattr(cli.platform, "libc_ver", lambda: ("glibc", "2.36"))
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(cli, "THP_MODE", mode)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    return calls


def test_quantize_runs_again_with_huge_pages_keeping_other_tunables(reruns, monkeypatch):
    cli.with_huge_pages(["quantize", "model.gguf", "out"])
    assert len(reruns) == 1
    path, argv, env = reruns[0]
    assert path == sys.executable and argv == sys.orig_argv and env["GLIBC_TUNABLES"] == cli.HUGE_PAGES
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    cli.with_huge_pages(["quantize", "model.gguf", "out"])
    assert reruns[1][2]["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + cli.HUGE_PAGES


def test_no_rerun_once_set_for_other_commands_or_without_huge_pages(reruns, monkeypatch):
    cli.with_huge_pages(["serve", "--config", "x.yaml"])
    cli.with_huge_pages([])
    monkeypatch.setenv("GLIBC_TUNABLES", cli.HUGE_PAGES)  # the run again itself: never a loop
    cli.with_huge_pages(["quantize", "m", "o"])
    monkeypatch.delenv("GLIBC_TUNABLES")
    cli.THP_MODE.write_text("always madvise [never]\n")
    cli.with_huge_pages(["quantize", "m", "o"])
    monkeypatch.setattr(cli.platform, "libc_ver", lambda: ("musl", ""))
    cli.with_huge_pages(["quantize", "m", "o"])
    assert reruns == []


def test_a_quantize_process_runs_again_and_still_answers_in_one_line(tmp_path):
    """Through a real process (python -m bonsai_cli): the run again keeps the command line, and a user error still
    ends it with one line and exit 1; the child sees the tunable (where this machine's glibc takes it)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.run([sys.executable, "-m", "bonsai_cli", "quantize", str(tmp_path / "missing.gguf"),
                           str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: "), proc.stderr
    assert not (tmp_path / "out").exists()
