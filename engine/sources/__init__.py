"""Model files and what they describe: GGUF, Hugging Face and bonsai checkpoints, the architecture,
the tokenizer and chat template, and the store of pulled models. Nothing here allocates a model."""
