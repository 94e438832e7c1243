"""Write a metadata-only copy of a GGUF (every key/value, no tensors): a tokenizer that travels where the model
cannot (the device copies at most 64 MiB a call; SmolLM2's 92 MB GGUF becomes ~1.8 MB). A generated-weight
server borrows it as `model.tokenizer`.

    python3 tests/perf/tokenizer_gguf.py ~/.cache/bonsai/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf .tok/smollm2.gguf
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import gguf


def write_metadata_only(src: Path, dst: Path) -> int:
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field("general.architecture")
    writer = gguf.GGUFWriter(str(dst) + ".tmp", arch=bytes(arch.parts[arch.data[0]]).decode())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own fields, and the one the writer adds itself
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            item = field.types[1]
            values = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") if item == gguf.GGUFValueType.STRING
                      else field.parts[i][0].item() for i in field.data]
            writer.add_array(name, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape"))
        else:
            writer.add_key_value(name, field.parts[field.data[0]][0].item(), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    os.replace(str(dst) + ".tmp", dst)
    return dst.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    args = parser.parse_args()
    args.dst.parent.mkdir(parents=True, exist_ok=True)
    print(f"{args.dst}: {write_metadata_only(args.src, args.dst):,} bytes")


if __name__ == "__main__":
    main()
