"""Dependencies point one way: quant → nothing of ours; engine → quant; only bonsai_cli reads YAML."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"quant": {"engine", "bonsai_cli"}, "engine": {"bonsai_cli"}}


def imported_top_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_one_way_dependencies():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in (ROOT / package).rglob("*.py"):
            hits = imported_top_modules(path) & forbidden
            if hits:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, bad


def test_only_the_cli_reads_yaml():
    bad = [str(p.relative_to(ROOT)) for package in ("engine", "quant") for p in (ROOT / package).rglob("*.py")
           if "yaml" in imported_top_modules(p)]
    assert not bad, bad


def test_the_rule_catches_a_planted_violation(tmp_path):
    planted = tmp_path / "bad.py"
    planted.write_text("from engine.runtime.model import Transformer\nimport bonsai_cli.main\n")
    assert {"engine", "bonsai_cli"} <= imported_top_modules(planted)


def test_files_stay_small():
    long = [f"{p.relative_to(ROOT)}: {n}" for package in ("engine", "quant", "bonsai_cli")
            for p in (ROOT / package).rglob("*.py") if (n := len(p.read_text().splitlines())) > 450]
    assert not long, long
