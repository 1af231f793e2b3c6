"""Benchmark jaxserve: `python scripts/bench.py [--help]` (logic in jaxserve/bench/cli.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
