"""`python scripts/bench.py --help`: workload and engine flags derived from the dataclasses."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from jaxserve.bench.cli import parse_args
from jaxserve.bench.workload import WorkloadConfig
from jaxserve.config import EngineConfig


def test_help_lists_every_engine_and_workload_field_with_its_description():
    out = subprocess.run([sys.executable, "scripts/bench.py", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    flat = " ".join(out.split())  # argparse wraps help lines
    for cls, skip in ((EngineConfig, ("seed", "enable_step_trace")), (WorkloadConfig, ())):
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            assert "--" + f.name.replace("_", "-") in out, f.name
            assert " ".join(f.metadata["help"].split()[:4]) in flat, f.name


def test_engine_flags_default_to_the_engine_config():
    args = parse_args([])
    for f in dataclasses.fields(EngineConfig):
        if f.name not in ("seed", "enable_step_trace"):
            assert getattr(args, f.name) == f.default, f.name
    assert parse_args(["--max-num-seqs", "8"]).max_num_seqs == 8
