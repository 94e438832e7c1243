"""How `bonsai bench` shows results: rich tables, the JSON file (written atomically, also when a
run is cut short), the plot, and `--compare` ratios."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from engine.errors import BonsaiError

SCHEMA_VERSION = 1


def write_json(report: dict[str, Any], path: Path) -> None:
    """Write to a temporary name and rename: a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False))
    os.replace(tmp, path)


def _weights(m: dict[str, Any]) -> str:
    packed = m.get("weights", "bf16")
    if packed == "bf16" and m.get("head_weights", "bf16") == "bf16":
        int4, head = m.get("int4_layers", 0), m.get("output_layer")
        kernels = m.get("cpu_kernels") or "torch"
        body = f", {m['cpu_body']}" if m.get("cpu_body") else ""
        stored = f"{int4} int4 as stored" if kernels == "torch" else f"{int4} as stored (native CPU kernels{body})"
        return (m["weight_dtype"] + (f" + {stored}" if int4 else "")
                + (f", output layer {head} (top logits exact)" if head else ""))
    return f"{packed} g{m.get('group_size')} (head {m.get('head_weights')})"


def _kv(m: dict[str, Any]) -> str:
    kv_type = m.get("kv_type", "bf16")
    return m["kv_dtype"] if kv_type == "bf16" else kv_type


def model_table(report: dict[str, Any]) -> Table:
    m = report["model"]
    table = Table(title=f"{m['name']} · {m['architecture']} · {m['parameters'] / 1e6:.0f}M params · "
                        f"{m['bits_per_weight']:.2f} bpw · weights {_weights(m)} · KV {_kv(m)} · "
                        f"{report['environment']['device']}")
    spec = any("speculative" in t for t in report["tests"])
    for col in ("test", "tok/s", "± std", "runs", "bytes/token", "GB/s", "of copy BW") + (("accepted", "tok/pass") if spec else ()):
        table.add_column(col, justify="right" if col != "test" else "left")
    for t in report["tests"]:
        bw = t.get("decode_bandwidth") or {}
        sp = t.get("speculative")
        table.add_row(t["name"], f"{t['tokens_per_second']:.2f}", f"{t['stddev']:.2f}", str(len(t["samples_tps"])),
                      f"{bw['bytes_per_token'] / 1e6:.1f} MB" if bw else "",
                      f"{bw['achieved_gb_per_s']:.1f}" if bw else "",
                      f"{100 * bw['fraction_of_copy']:.0f}%" if bw else "",
                      *((f"{100 * sp['acceptance']:.0f}%", f"{sp['mean_accepted_length']:.2f}") if sp else ("", ""))[:2 if spec else 0])
    return table


def suite_table(summary: dict[str, dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in ("category", "runs", "tokens", "decode tok/s", "± std", "TTFT ms", "TTFT p90", "ITL p50 ms", "ITL p90"):
        table.add_column(col, justify="right" if col != "category" else "left")
    for name, s in summary.items():
        style = "bold" if name == "overall" else None
        table.add_row(name, str(s["runs"]), str(s["generated_tokens"]), f"{s['decode_tokens_per_second']:.2f}",
                      f"{s['decode_stddev']:.2f}", f"{s['ttft_ms_mean']:.0f}", f"{s['ttft_ms_p90']:.0f}",
                      f"{s['itl_ms_p50']:.1f}", f"{s['itl_ms_p90']:.1f}", style=style)
    return table


def speculative_table(summary: dict[str, dict[str, Any]], title: str, speedup: dict[str, float] | None) -> Table:
    """Per category: drafted, accepted, acceptance, tokens per target pass, and the speedup over plain."""
    table = Table(title=title)
    columns = ["category", "passes", "drafted", "accepted", "acceptance", "tok/pass"] + (["speedup"] if speedup else [])
    for col in columns:
        table.add_column(col, justify="right" if col != "category" else "left")
    for name, s in summary.items():
        sp = s.get("speculative")
        if not sp:
            continue
        row = [name, str(sp["steps"]), str(sp["drafted"]), str(sp["accepted"]), f"{100 * sp['acceptance']:.0f}%",
               f"{sp['mean_accepted_length']:.2f}"]
        if speedup:
            row.append(f"{speedup[name]:.2f}x" if name in speedup else "")
        table.add_row(*row, style="bold" if name == "overall" else None)
    return table


def drafter_table(summary: dict[str, dict[str, Any]]) -> Table:
    """Per category and drafter: drafted, accepted, acceptance."""
    table = Table(title="drafters")
    for col in ("category", "drafter", "proposals", "drafted", "accepted", "acceptance"):
        table.add_column(col, justify="right" if col not in ("category", "drafter") else "left")
    for name, s in summary.items():
        for drafter, c in s.get("speculative", {}).get("by_drafter", {}).items():
            table.add_row(name, drafter, str(c["proposals"]), str(c["drafted"]), str(c["accepted"]),
                          f"{100 * c['acceptance']:.0f}%", style="bold" if name == "overall" else None)
    return table


def concurrency_table(levels: list[dict[str, Any]]) -> Table:
    table = Table(title="throughput by concurrency")
    drafting = any(lv["summary"].get("draft_tokens") for lv in levels)
    vs_plain = all("plain" in lv for lv in levels)  # --vs-plain: the same requests with drafting off, same server
    for col in ("concurrency", "requests", "tokens", "aggregate tok/s", "per-request tok/s", "TTFT p50 ms", "TTFT p90 ms",
                "ITL p50 ms", "ITL p99 ms", *(("drafts accepted",) if drafting else ()),
                *(("plain tok/s", "x plain", "identical") if vs_plain else ())):
        table.add_column(col, justify="right")
    for lv in levels:
        s = lv["summary"]
        spec = ((f"{s['draft_tokens_accepted']}/{s['draft_tokens']} ({100 * s['draft_acceptance']:.0f}%)",)
                if drafting else ())
        if vs_plain:
            spec += (f"{lv['plain']['summary']['aggregate_tokens_per_second']:.1f}", f"{lv['speedup']:.2f}x",
                     f"{lv['identical_outputs']}/{s['requests']}")
        table.add_row(str(lv["concurrency"]), str(s["requests"]), str(s["generated_tokens"]),
                      f"{s['aggregate_tokens_per_second']:.1f}", f"{s['decode_tps_mean']:.1f} ± {s['decode_tps_std']:.1f}",
                      f"{s['ttft_ms_p50']:.0f}", f"{s['ttft_ms_p90']:.0f}", f"{s['itl_ms_p50']:.1f}", f"{s['itl_ms_p99']:.1f}",
                      *spec)
    return table


def print_report(report: dict[str, Any], console: Console) -> None:
    if report.get("tests"):
        console.print(model_table(report))
    if report.get("plain_suite", {}).get("by_category"):
        console.print(suite_table(report["plain_suite"]["by_category"], f"suite {report['plain_suite']['name']} (plain)"))
    if report.get("suite", {}).get("by_category"):
        suite = report["suite"]
        spec = report.get("speculative", {})
        title = f"suite {suite['name']}" + (f" · speculative {spec['method']} k={spec['num_draft_tokens']}"
                                            if spec.get("active") else "")
        console.print(suite_table(suite["by_category"], title))
        if spec.get("active"):
            console.print(speculative_table(suite["by_category"], "speculative decoding by category",
                                            suite.get("speedup")))
            console.print(drafter_table(suite["by_category"]))
        if "outputs_compared" in suite:
            bad = suite["output_mismatches"]
            console.print(f"[{'red' if bad else 'green'}]{suite['outputs_compared'] - len(bad)} of "
                          f"{suite['outputs_compared']} greedy outputs identical to plain decoding[/]")
            for line in bad:
                console.print(f"[red]mismatch: {line}[/red]")
    if report.get("concurrency"):
        console.print(concurrency_table(report["concurrency"]))
    gemv = (report.get("settings") or {}).get("decode_gemv")
    if gemv:
        console.print("decode GEMV: " + "; ".join(f"{shape} {path}" for shape, path in gemv.items()))
    attention = (report.get("settings") or {}).get("decode_attention")
    if attention:
        console.print(f"decode attention: {attention}")
    memory = report.get("memory")
    if memory:
        peak = memory.get("peak_allocated_bytes")
        limit = memory.get("max_gpu_memory")
        console.print(f"memory: plan {memory['planned_bytes'] / 1e9:.2f} GB"
                      + (f", allocator peak {peak / 1e9:.2f} GB allocated, "
                         f"{memory['peak_reserved_bytes'] / 1e9:.2f} GB reserved" if peak is not None else
                         " (no allocator statistics on the CPU)")
                      + (f", limit {limit / 1e9:.2f} GB" if limit else ""))
    if not report.get("complete", True):
        console.print("[yellow]the run was interrupted: these are partial results[/yellow]")


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BonsaiError("--plot needs matplotlib: pip install matplotlib") from None
    if report.get("tests"):
        labels = [t["name"] for t in report["tests"]]
        values = [t["tokens_per_second"] for t in report["tests"]]
        errors = [t["stddev"] for t in report["tests"]]
        ylabel = "tokens / second"
    elif report.get("suite", {}).get("by_category"):
        cats = report["suite"]["by_category"]
        labels = list(cats)
        values = [c["decode_tokens_per_second"] for c in cats.values()]
        errors = [c["decode_stddev"] for c in cats.values()]
        ylabel = "decode tokens / second"
    elif report.get("concurrency"):
        labels = [str(lv["concurrency"]) for lv in report["concurrency"]]
        values = [lv["summary"]["aggregate_tokens_per_second"] for lv in report["concurrency"]]
        errors = [0.0] * len(values)
        ylabel = "aggregate tokens / second"
    else:
        raise BonsaiError("nothing to plot: the run produced no results")
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels) + 2), 4))
    bars = ax.bar(labels, values, yerr=errors, capsize=4, color="#3a7d44")
    ax.bar_label(bars, fmt="%.1f", padding=2)
    ax.set_ylabel(ylabel)
    ax.set_title(f"bonsai bench · {report['model']['name']} · {report['environment']['device']}")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".partial" + path.suffix)
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def load_report(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise BonsaiError(f"no such benchmark file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BonsaiError(f"{path} is not a bonsai bench JSON file ({e})") from None
    if not isinstance(data, dict) or data.get("bonsai_bench") != SCHEMA_VERSION:
        raise BonsaiError(f"{path} is not a bonsai bench JSON file (written by `bonsai bench --json`)")
    return data


def comparable_values(report: dict[str, Any]) -> dict[str, float]:
    """Every headline number of a report under a stable key (higher is better for all)."""
    values = {f"test {t['name']}": t["tokens_per_second"] for t in report.get("tests", [])}
    for cat, s in report.get("suite", {}).get("by_category", {}).items():
        values[f"suite {cat} decode tok/s"] = s["decode_tokens_per_second"]
    for lv in report.get("concurrency", []):
        values[f"concurrency {lv['concurrency']} aggregate tok/s"] = lv["summary"]["aggregate_tokens_per_second"]
    return values


def compare_table(a: dict[str, Any], b: dict[str, Any], name_a: str, name_b: str) -> Table:
    va, vb = comparable_values(a), comparable_values(b)
    common = [k for k in va if k in vb]
    if not common:
        raise BonsaiError("the two benchmark files measured nothing in common (different tests or suites)")
    table = Table(title=f"{name_b} vs {name_a}")
    for col in ("measure", name_a, name_b, "ratio"):
        table.add_column(col, justify="right" if col != "measure" else "left")
    for k in common:
        ratio = vb[k] / va[k] if va[k] else float("nan")
        table.add_row(k, f"{va[k]:.2f}", f"{vb[k]:.2f}", f"{ratio:.2f}x")
    return table


def output_mismatches(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, list[str]]:
    """Greedy suite runs of the same prompts must give the same tokens (e.g. plain vs speculative
    decoding, or two builds): (outputs compared, one line per mismatch). Runs are paired by prompt
    id and repetition, since each repetition uses its own fresh variant of the prompt."""
    def keyed(report: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
        seen: dict[str, int] = {}
        out = {}
        for r in report.get("suite", {}).get("results", []):
            n = seen.get(r["prompt_id"], 0)
            seen[r["prompt_id"]] = n + 1
            out[(r["prompt_id"], n)] = r
        return out

    if any(rep.get("settings", {}).get("temperature", 0.0) != 0.0 for rep in (a, b)):
        return 0, []
    ka, kb = keyed(a), keyed(b)
    compared, problems = 0, []
    for key in (k for k in ka if k in kb):
        ra, rb = ka[key], kb[key]
        sa = ra["output_token_ids"] or ra["output_text"]
        sb = rb["output_token_ids"] or rb["output_text"]
        compared += 1
        if sa != sb:
            pos = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), min(len(sa), len(sb)))
            unit = "token" if ra["output_token_ids"] else "character"
            problems.append(f"{key[0]} (run {key[1] + 1}): outputs differ from {unit} {pos} on")
    return compared, problems
