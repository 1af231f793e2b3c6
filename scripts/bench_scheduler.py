"""Host overhead per step: `python scripts/bench_scheduler.py [--help]` (logic in
jaxserve/bench/host_overhead.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve.bench.host_overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
