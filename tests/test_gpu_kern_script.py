"""tests/perf/gpu_kern.py's CPU-runnable parts: its arguments, a miniature run of every section through
Triton's interpreter (the JSON's shape, the table), and a failing section recorded while the rest goes on."""
from __future__ import annotations

import json

import pytest

from tests.perf import gpu_kern


def test_arguments():
    args = gpu_kern.parse_args(["--json", "kern.json"])
    assert args.sections == list(gpu_kern.SECTIONS) and args.reps >= 20 and not args.tiny
    assert gpu_kern.parse_args(["--tiny", "--reps", "5"]).reps == 1
    with pytest.raises(SystemExit):
        gpu_kern.parse_args(["--sections", "gemv,nope"])
    with pytest.raises(SystemExit):
        gpu_kern.parse_args(["--reps", "5"])  # too few samples for a median on the GPU


def test_copy_bandwidth_section():
    run = gpu_kern.Run(gpu_kern.parse_args(["--tiny", "--sections", "copy"]))
    gpu_kern.section_copy(run)
    assert run.results["copy_gb_per_s"] > 0 and run.results["copy"]["bytes"] == 2 * (16 << 20)


def test_miniature_run_checks_times_and_survives_a_failing_section(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_kern, "TINY_SHAPES", {"8b gate_up": (40, 256), "8b down": (24, 512)})
    monkeypatch.setattr(gpu_kern, "TINY_ROWS", (1, 16))

    def planted(run):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(gpu_kern, "section_copy", planted)
    out = tmp_path / "kern.json"
    assert gpu_kern.main(["--tiny", "--json", str(out)]) == 1  # an error: exit 1, everything else still ran
    results = json.loads(out.read_text())
    assert results["errors"] == {"copy": "RuntimeError: planted failure"} and results["copy_gb_per_s"] is None
    assert len(results["checks"]) == 2 * 2 + 2 * 2 * 2 * 2 and all(c["ok"] for c in results["checks"])
    assert [(r["shape"], r["kind"]) for r in results["gemv"]] == [
        ("8b gate_up", "tri"), ("8b gate_up", "tri5"), ("8b down", "tri"), ("8b down", "tri5")]
    gemv = results["gemv"][1]
    assert gemv["checked"] and gemv["share_of_copy"] is None and gemv["copies"] >= 2 and gemv["bytes"] == 40 * (13 * 4 + 2 * 2)
    assert {(r["kind"], r["shape"], r["rows"], r["path"]) for r in results["rows"]} == {
        (k, s, m, p) for k in ("tri", "int4") for s in ("8b gate_up", "8b down") for m in (1, 16) for p in ("dp4a", "mma")}
    first = [r for r in results["rows"] if r["rows"] == 1]
    assert all(r["rel_to_1_row"] == 1.0 and r["checked"] for r in first)
    printed = capsys.readouterr().out
    assert "batch-1 GEMV" in printed and "tri5 us" in printed and "ERROR in copy: RuntimeError" in printed
    assert "tri 8b down mma" in printed
