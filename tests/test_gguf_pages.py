"""A GGUF read tensor by tensor keeps one tensor of the file resident, not every page read so far
(engine.sources.gguf_reader.release_pages): `bonsai quantize` reads a model layer by layer and its peak
memory is measured as resident memory (VmHWM), in which the mapped file's pages count."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.sources.gguf_reader import read_gguf, release_pages, tensor_bytes


def rss_file_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssFile:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def write_file(path: Path, tensors: int, rows: int, cols: int) -> None:
    writer = gguf.GGUFWriter(str(path), arch="llama")
    rng = np.random.default_rng(0)
    for i in range(tensors):
        writer.add_tensor(f"blk.{i}.ffn_up.weight", rng.standard_normal((rows, cols), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.skipif(rss_file_mib() is None, reason="needs Linux's /proc/self/status RssFile")
def test_released_pages_leave_the_resident_set_and_read_back_the_same(tmp_path):
    path = tmp_path / "big.gguf"
    write_file(path, tensors=8, rows=1024, cols=1024)  # 8 x 4 MiB
    _, tensors, data = read_gguf(path)
    before = rss_file_mib()
    sums = []
    for t in tensors:
        sums.append(float(np.asarray(tensor_bytes(data, t)).view(np.float32).sum()))  # every page touched
        release_pages(data, t)
    grown = rss_file_mib() - before
    assert grown < 8, f"{grown:.1f} MiB of the 32 MiB file still resident"
    again = [float(np.asarray(tensor_bytes(data, t)).view(np.float32).sum()) for t in tensors]
    assert again == sums  # released pages fault back in from the file, unchanged
    kept = rss_file_mib() - before
    assert kept > 24, f"without release_pages the pages stay resident ({kept:.1f} MiB)"
