"""The pipelined server's config reaches every stage. Its own module: the pipelines that
tests/test_pipeline.py keeps open for its module (one torch.distributed group per process) must be
closed before this one starts."""
from __future__ import annotations

import torch


def test_pipelined_server_keeps_the_head_type_of_its_config(tmp_path, smollm2_gguf, one_thread):
    """model.head_type reaches every pipeline stage (the pipelined loader once built its weight format without
    it, while the plan counted it): the two-process engine gives the logits of the one-process engine with the
    same config, whose output layer is int4 (without it the last stage's was bf16: other logits), and its first
    stage allocates the bytes the plan gave it."""
    from bonsai_cli.cmd_serve import read_serve_config
    from bonsai_cli.run_options import architecture_of
    from engine.pipeline.setup import plan_pipeline
    from engine.run.plan import plan_run
    from engine.server.engine_thread import start_serving
    arch = tmp_path / "tiny.yaml"
    arch.write_text("architectures: [Qwen3ForCausalLM]\nvocab_size: 49152\nhidden_size: 64\nintermediate_size: 128\n"
                    "num_hidden_layers: 2\nnum_attention_heads: 4\nnum_key_value_heads: 2\nhead_dim: 32\n"
                    "tie_word_embeddings: false\n")
    logits = {}
    for name, runtime in (("single", "  device: cpu\n"), ("pipe", "  device: cpu,cpu\n")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"model:\n  path: {arch}\n  load_format: dummy\n  tokenizer: {smollm2_gguf}\n  quant_type: tri\n"
                        f"  group_size: 32\n  head_type: int4\nruntime:\n{runtime}  max_seq_len: 64\n"
                        + ("memory:\n  pipeline_parallel: true\n" if name == "pipe" else ""))
        config = read_serve_config(path)
        served = start_serving(config, architecture=architecture_of(config))
        try:
            runner = served.engine.runner
            logits[name] = runner.prefill(runner.slot(0), [1, 2, 3, 4, 5]).clone()  # [V]
            if name == "pipe":
                planned = plan_run(config, architecture_of(config))
                pp = plan_pipeline(planned.weights.config, planned.weights.formats, planned.settings, ["cpu", "cpu"])
                held = sum(t.numel() * t.element_size()  # what stage 0 allocated (other stages' parts stay meta)
                           for t in [*runner.loaded.model.parameters(), *runner.loaded.model.buffers()] if not t.is_meta)
                assert held == pp.plans[0].categories()["weights"]
        finally:
            served.stop()
    assert torch.equal(logits["pipe"], logits["single"])
