"""Serving: one serving core (core.py) behind the msgpack socket protocol (socket_front.py) and
the HTTP front (openai/: OpenAI's API and Anthropic's Messages API, one module each), with
clients, Prometheus metrics, disaggregated prefill/decode (disagg.py) and the server's command
line (cli.py: `jaxserve serve`, `scripts/serve.py`)."""
