"""The network on its device: the model, its KV cache, the fused decode step, CUDA graphs, the runner."""
