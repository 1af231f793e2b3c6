"""Benchmark jaxserve: `python scripts/bench.py [--help]` (logic in jaxserve/bench/cli.py)."""

import sys

from jaxserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
