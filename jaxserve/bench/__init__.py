"""The benchmark harness: seeded workloads, drivers (in process, over the socket, HF baselines),
reports (table, JSON), step timelines, plots, and the `scripts/bench.py` command line."""
