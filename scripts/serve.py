"""Serve a model: `python scripts/serve.py [--help]` (default: bundled SmolLM2-135M-Instruct)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve.serving.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
