"""Host overhead per step: `python scripts/bench_scheduler.py [--help]` (logic in
jaxserve/bench/host_overhead.py)."""

import sys

from jaxserve.bench.host_overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
