"""Checks on where a command will write, made before its work starts."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from engine.errors import BonsaiError


def check_writable(*targets: Path | None) -> None:
    """Each target (a file or directory to be created; None is skipped) can be written: its nearest
    existing parent takes a new file, tried for real (so permissions, read-only mounts and root's
    exemptions all count). One line otherwise, before any work is done."""
    for target in targets:
        if target is None:
            continue
        parent = Path(target).expanduser().absolute().parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise BonsaiError(f"cannot write {target}: {parent} is not a directory")
        try:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".bonsai-write-check-")
        except OSError as e:
            raise BonsaiError(f"cannot write {target}: the directory {parent} is not writable "
                              f"({e.strerror or e}); choose a place you can write to") from None
        os.close(fd)
        os.remove(probe)
