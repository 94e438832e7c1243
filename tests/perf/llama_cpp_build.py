"""Build llama.cpp's CPU tools (llama-bench, llama-perplexity) from the llama-cpp-python sdist, once.

Usage: python tests/perf/llama_cpp_build.py [--dir /work/build/llama.cpp] [--jobs 2]
Prints the bin/ directory. An existing build is reused (the tree is shared with other perf work);
a lock file keeps two builds of the same tree from running at once. Not part of CI.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"  # its vendor/llama.cpp is the build field-notes §8 measured on the H200
DEFAULT_DIR = Path(os.environ.get("LLAMA_CPP_DIR", "/work/build/llama.cpp"))
TARGETS = ("llama-bench", "llama-perplexity")


def build(root: Path = DEFAULT_DIR, jobs: int = 2, log=lambda s: print(s, file=sys.stderr)) -> Path:
    """root/build/bin with the TARGETS, built if missing (CPU only, native ISA)."""
    bin_dir = root / "build" / "bin"
    if all((bin_dir / t).is_file() for t in TARGETS):
        return bin_dir
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / (root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same tree
        if all((bin_dir / t).is_file() for t in TARGETS):
            return bin_dir
        if not (root / "CMakeLists.txt").is_file():
            _unpack_sources(root, log)
        log(f"configuring llama.cpp in {root / 'build'} (CPU, native)")
        subprocess.run(["cmake", "-S", str(root), "-B", str(root / "build"), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"], check=True)
        log(f"building {', '.join(TARGETS)} with -j{jobs} (tens of minutes on 2 cores)")
        subprocess.run(["cmake", "--build", str(root / "build"), "--config", "Release", f"-j{jobs}",
                        "--target", *TARGETS], check=True)
    return bin_dir


def _unpack_sources(root: Path, log) -> None:
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".sdist-") as tmp:
        log(f"downloading the {SDIST} source package")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "--disable-pip-version-check", "-d", tmp, SDIST], check=True)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tf:
            members = [m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name]
            tf.extractall(tmp, members=members, filter="data")
        vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        shutil.move(str(vendored), str(root))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    print(build(args.dir, args.jobs))


if __name__ == "__main__":
    main()
