"""The decoding core: requests in, tokens and text out (sampling, end rules, speculation, slots)."""
