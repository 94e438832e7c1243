"""Where the bytes live: the memory plan made before loading, the limit enforced while running, and
what is kept in host memory (offloaded KV cache and weights, the embedding table)."""
