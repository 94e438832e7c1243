"""`bonsai bench` end to end: JSON schema, suites, --url against a stub server, compare, plot, bad input."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.stub_openai_server import closed_port_url, running_stub
from tests.test_cli_errors import assert_one_line_error, bonsai_in_process

TINY_ARCH = ("architectures: [Qwen3ForCausalLM]\nvocab_size: 512\nhidden_size: 64\nintermediate_size: 128\n"
             "num_hidden_layers: 2\nnum_attention_heads: 4\nnum_key_value_heads: 2\nhead_dim: 16\n")
ENV_KEYS = {"python", "torch", "triton", "device", "cpu", "git_commit", "torch_threads"}


@pytest.mark.slow
def test_model_run_json_schema_and_plot(smollm2_gguf, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    proc = bonsai_in_process(capsys, "bench", str(smollm2_gguf), "-p", "16", "-n", "8", "-r", "2", "--json", str(out),
                             "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["bonsai_bench"] == 1 and report["complete"] is True
    assert ENV_KEYS <= set(report["environment"])
    assert report["speculative"] == {"active": False, "drafters": []}
    assert report["caches"]["prefix_reuse"] is False
    assert {"name", "architecture", "parameters", "bits_per_weight", "weight_dtype", "kv_dtype"} <= set(report["model"])
    names = [t["name"] for t in report["tests"]]
    assert names == ["pp16", "tg8", "pp16+tg8"]
    for t in report["tests"]:
        assert len(t["samples_tps"]) == 2 and t["tokens_per_second"] > 0
    bw = report["tests"][1]["decode_bandwidth"]
    # SmolLM2's Q4_1 matrices as stored (~66 MB; native: 74 MB, its 576-wide rows padded to 640) and its output
    # layer's int8 codes (28 MB; float16: 57 MB; native: its Q8_0 blocks, 35 MB)
    head = report["model"]["output_layer"]
    assert head in ("int8", "float16", "as stored")  # as stored: the native CPU kernels' head (engine.runtime.cpu_kquant)
    assert (head == "as stored") == (report["model"]["cpu_kernels"] == "native")
    assert (90e6 if head in ("int8", "as stored") else 120e6) < bw["bytes_per_token"] < 130e6 and 0 < bw["fraction_of_copy"] < 5
    assert png.read_bytes()[:4] == b"\x89PNG"
    compare = bonsai_in_process(capsys, "bench", "--compare", str(out), "--compare", str(out))
    assert compare.returncode == 0 and "1.00x" in compare.stdout


@pytest.mark.slow
def test_suite_run_reports_by_category(smollm2_gguf, tmp_path, capsys):
    out = tmp_path / "s.json"
    proc = bonsai_in_process(capsys, "bench", str(smollm2_gguf), "--suite", "short", "--categories", "code,math",
                             "-r", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    suite = json.loads(out.read_text())["suite"]
    assert set(suite["by_category"]) == {"code", "math", "overall"}
    assert len(suite["results"]) == 2 and all(r["generated_tokens"] > 0 for r in suite["results"])
    assert all(r["cached_tokens"] == 0 for r in suite["results"])  # fresh prompts, no prefix reuse


def test_url_run_against_stub_server(tmp_path, capsys):
    out = tmp_path / "u.json"
    with running_stub(tokens=12, token_delay=0.002, timings={"cache_n": 0, "draft_n": 6, "draft_n_accepted": 4}) as url:
        proc = bonsai_in_process(capsys, "bench", "--url", url, "--suite", "short", "--limit", "1", "--categories",
                                 "qa,code", "--concurrency", "1,2", "-r", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in report["concurrency"]] == [1, 2]
    assert report["concurrency"][0]["summary"]["generated_tokens"] == 24
    assert report["suite"]["results"][0]["drafted"] == 6 and report["suite"]["results"][0]["accepted"] == 4


def test_url_run_vs_plain_sends_each_level_both_ways(tmp_path, capsys):
    """--url --vs-plain: every level runs its requests as served and again with "speculative.n_max": 0 (llama.cpp's
    per-request field), the order alternating by level; the report has both, the speedup and identical outputs."""
    out, seen = tmp_path / "v.json", []
    with running_stub(tokens=8, token_delay=0.001, requests_seen=seen) as url:
        proc = bonsai_in_process(capsys, "bench", "--url", url, "--suite", "short", "--limit", "1", "--categories",
                                 "qa,code", "--concurrency", "1,2", "-r", "1", "--vs-plain", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    for level in report["concurrency"]:
        assert level["plain"]["summary"]["generated_tokens"] == level["summary"]["generated_tokens"] == 16
        assert level["speedup"] > 0 and level["identical_outputs"] == 2
    chats = [r["body"] for r in seen if r["path"] == "/v1/chat/completions"][1:]  # after the warm-up
    assert len(chats) == 8
    off = [b.get("speculative.n_max") == 0 for b in chats]
    assert off == [True, True, False, False, False, False, True, True]  # level 1: plain first; level 2: served first
    assert "as served / plain" in proc.stderr and "2 of 2 greedy outputs identical" in proc.stderr


def test_interrupted_run_keeps_partial_results(tmp_path):
    """A real SIGINT in the middle of a run (a fresh process, a small generated model): the tests
    measured so far stay in the JSON, marked incomplete, exit code 130. The decode tests after pp8
    run long (tens of seconds) so the signal always lands inside the run."""
    arch, out = tmp_path / "tiny.yaml", tmp_path / "p.json"
    arch.write_text(TINY_ARCH)
    proc = subprocess.Popen([sys.executable, "-m", "bonsai_cli", "bench", str(arch), "--load-format", "dummy",
                             "-p", "8", "-n", "2048,2049,2050,2051", "-r", "5", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # an ignored SIGINT is inherited (and Python then installs no handler): the
                            # child starts with the default disposition whatever earlier tests left behind
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (out.exists() and json.loads(out.read_text()).get("tests")):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # never leave a benchmark running behind a failed test
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["tests"][0]["name"] == "pp8"


def test_bad_input_is_one_line(capsys):
    def run(*args: str):
        return bonsai_in_process(capsys, *args)
    assert_one_line_error(run("bench", "--url", closed_port_url(), "--suite", "short"), "cannot reach the server")
    assert_one_line_error(run("bench", "--suite", "no-such-suite", "--url", "http://127.0.0.1:9"), "unknown suite")
    with running_stub(mode="html_models") as url:
        assert_one_line_error(run("bench", "--url", url), "not an OpenAI-compatible server")
    with running_stub(mode="zero_tokens") as url:
        assert_one_line_error(run("bench", "--url", url, "--limit", "1", "--categories", "qa"), "generated no tokens")
    assert_one_line_error(run("bench", "--compare", "a.json"), "exactly two JSON files")
    assert_one_line_error(run("bench", "-p", "x"), "comma-separated integers")


def _suite_report(outputs: dict[str, list[int]], temperature: float = 0.0) -> dict:
    results = [{"prompt_id": pid, "category": "code", "output_token_ids": ids, "output_text": "",
                "decode_tokens_per_second": 10.0, "generated_tokens": len(ids), "prompt_tokens": 5,
                "ttft_seconds": 0.1, "inter_token_seconds": [0.1]} for pid, ids in outputs.items()]
    return {"bonsai_bench": 1, "complete": True, "settings": {"temperature": temperature},
            "suite": {"name": "t", "results": results,
                      "by_category": {"overall": {"decode_tokens_per_second": 10.0}}}}


def test_identical_output_check_catches_a_planted_mismatch(tmp_path, capsys):
    from bonsai_cli.bench_report import output_mismatches, write_json

    base = _suite_report({"a": [1, 2, 3], "b": [4, 5, 6]})
    same = _suite_report({"a": [1, 2, 3], "b": [4, 5, 6]})
    planted = _suite_report({"a": [1, 2, 3], "b": [4, 9, 6]})
    assert output_mismatches(base, same) == (2, [])
    compared, problems = output_mismatches(base, planted)
    assert compared == 2 and len(problems) == 1 and "b (run 1): outputs differ from token 1" in problems[0]
    assert output_mismatches(base, _suite_report({"a": [7]}, temperature=0.7)) == (0, [])  # sampled: not comparable
    for name, rep in (("base", base), ("same", same), ("planted", planted)):
        write_json(rep, tmp_path / f"{name}.json")
    ok = bonsai_in_process(capsys, "bench", "--compare", str(tmp_path / "base.json"), "--compare",
                           str(tmp_path / "same.json"))
    assert ok.returncode == 0 and "identical" in ok.stderr
    bad = bonsai_in_process(capsys, "bench", "--compare", str(tmp_path / "base.json"), "--compare",
                            str(tmp_path / "planted.json"))
    assert bad.returncode == 1 and "1 of 2 greedy outputs differ" in bad.stderr and "mismatch: b" in bad.stderr
