"""One run: its config (model, runtime, memory, speculation, thinking, context) and its builder."""
