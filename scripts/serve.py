"""Serve a model: `python scripts/serve.py [--help]` (default: bundled SmolLM2-135M-Instruct)."""

import sys

from jaxserve.serving.cli import main

if __name__ == "__main__":
    sys.exit(main())
