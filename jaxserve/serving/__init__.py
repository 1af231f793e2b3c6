"""Serving: one engine thread behind the msgpack socket protocol and the OpenAI-compatible HTTP
front, with clients, Prometheus metrics and the `scripts/serve.py` command line."""
