"""The soak script's short form: 64 clients behaving well and badly for 30 s against a real
server process on the default model; nothing is lost, nothing leaks, the server stops with
status 0."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# The soak's prompts are a few tokens and its outputs at most 48 (soak.py's --max-tokens), so
# 128 tokens hold any request; two token and two block buckets are four programs to warm up.
SMALL_SERVER = ["--max-num-seqs", "16", "--max-num-batched-tokens", "64", "--max-model-len",
                "128", "--num-kv-blocks", "128", "--token-buckets", "16", "64",
                "--block-buckets", "4", "8"]


def test_thirty_second_soak():
    r = subprocess.run([sys.executable, "scripts/soak.py", "--duration-s", "30", "--clients",
                        "64", "--", *SMALL_SERVER], capture_output=True, text=True, timeout=600)
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["num_failures"] == 0, report["failures"]
    server = report["server"]
    assert server["num_running"] == server["num_waiting"] == server["kv_blocks_used"] == 0
    assert report["server_exit_code"] == 0
    # Every kind of client ran, and well-formed requests were answered.
    for key in ("answered", "disconnects", "aborts", "slow_readers", "bad_frames"):
        assert report.get(key, 0) > 0, (key, report)
    # What was generated after clients left is at most about one step per departed request.
    assert server["tokens_after_disconnect"] <= server["num_disconnects"] * 2, report
