"""Benchmarks: llama-bench-style model runs, task suites, and runs against any OpenAI-compatible server."""
