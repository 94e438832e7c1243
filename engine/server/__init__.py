"""The OpenAI-compatible server: config, scheduler and slots, engine loop, HTTP routes."""
