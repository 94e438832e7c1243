"""One line per `bonsai bench --json` file in a folder (the perf scripts' summary.txt): each test's tok/s ± std,
bytes per token and share of the copy bandwidth, whether the decode step was graphed, whether the run completed.

    python3 tests/perf/bench_summary.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def summary_lines(folder: Path) -> list[str]:
    lines = []
    for path in sorted(folder.glob("bench-*.json")):
        r = json.loads(path.read_text())
        cells = []
        for t in r.get("tests", []):
            bw = t.get("decode_bandwidth") or {}
            extra = (f" ({bw['bytes_per_token'] / 1e9:.2f} GB/token, {100 * bw['fraction_of_copy']:.0f}% of copy BW, "
                     f"ceiling {bw['ceiling_tokens_per_second']:,.0f})" if bw else "")
            cells.append(f"{t['name']} {t['tokens_per_second']:,.1f} ± {t.get('stddev', 0):.1f}{extra}")
        s = r.get("settings", {})
        kernels = sorted({p.split(" split")[0] for p in (s.get("decode_gemv") or {}).values()})
        lines.append(f"{path.stem} | " + " | ".join(cells) + f" | graph {s.get('cuda_graph')} | complete {r.get('complete')}"
                     + (f" | one-row kernels {', '.join(kernels)}" if kernels else "")
                     + (f" | attention {s['decode_attention']}" if s.get("decode_attention") else ""))
    return lines


if __name__ == "__main__":
    print("\n".join(summary_lines(Path(sys.argv[1]))))
