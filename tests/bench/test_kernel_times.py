"""Device time per kernel from a profiler's Perfetto trace: device lanes only, per call."""

from __future__ import annotations

import gzip
import json

from jaxserve.bench.kernel_times import describe, kernel_table, perfetto_file


def test_kernel_table_reads_the_device_lanes_per_call(tmp_path):
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 7, "tid": 1, "name": "gemm", "ts": 0, "dur": 500.0},  # host: not
    ]
    for call in range(2):  # two calls of a program: gemm twice and attention once per call
        t = call * 100
        events += [{"ph": "X", "pid": 1, "tid": 3, "name": "gemm", "ts": t, "dur": 10.0},
                   {"ph": "X", "pid": 1, "tid": 3, "name": "gemm", "ts": t + 20, "dur": 14.0},
                   {"ph": "X", "pid": 1, "tid": 3, "name": "attention", "ts": t + 40,
                    "dur": 30.0}]
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)

    path = perfetto_file(str(tmp_path))
    assert path == str(run / "perfetto_trace.json.gz")
    table = kernel_table(path, calls=2)
    assert table["busy_us"] == 54.0 and table["launches"] == 3
    assert [(k["name"], k["launches"], k["us"]) for k in table["kernels"]] == [
        ("attention", 1, 30.0), ("gemm", 2, 24.0)]
    assert describe(table)[1].split()[:2] == ["30.0", "us"]
    assert perfetto_file(str(tmp_path / "nothing")) is None
