"""Helpers shared by the commands: the stderr console, the one JSON object, draft statistics."""
from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

err_console = Console(stderr=True)


def print_json(obj: Any) -> None:
    """The one JSON object a --json command prints on stdout."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def spec_summary(spec) -> str:
    """One line of draft statistics for the terminal."""
    per = ", ".join(f"{name} {c.accepted}/{c.drafted}" for name, c in spec.by_drafter.items())
    return (f"speculative {spec.method}: {spec.accepted}/{spec.drafted} drafted tokens accepted "
            f"({100 * spec.acceptance:.0f}%), {spec.mean_accepted_length:.2f} tokens per target pass"
            + (f" [{per}]" if len(spec.by_drafter) > 1 else ""))
