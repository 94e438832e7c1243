"""Offline quantization: a model in, a bonsai checkpoint (or GGUF) out, and its evaluation."""
