"""The launcher's exit status names the process that failed first for its own reason."""

import os
import re
import signal

import pytest

from jaxserve.launch import launch
from jaxserve.runtime.distributed import ENV, EXIT_PEER_LOST

# Each child reads its index from the launcher's environment; process 0 plays the survivor that
# leaves at once with EXIT_PEER_LOST, process 1 the victim whose death is seen only later.
CHILD = f"""
import os, signal, sys, time
i = int(os.environ["{ENV['process_id']}"])
if i == 0:
    sys.exit({EXIT_PEER_LOST})
time.sleep(0.5)
os.kill(os.getpid(), signal.{{victim}})
"""


def test_a_peer_lost_exit_seen_first_does_not_hide_the_cause():
    code = launch(2, ["-c", CHILD.format(victim="SIGKILL")])
    assert code == 128 + signal.SIGKILL


def test_only_peer_lost_exits_report_peer_lost(capfd):
    code = launch(2, ["-c", f"import sys; sys.exit({EXIT_PEER_LOST})"])
    assert code == EXIT_PEER_LOST
    assert f"exit statuses: [{EXIT_PEER_LOST}, {EXIT_PEER_LOST}]" in capfd.readouterr().err


def test_all_clean_exits_return_zero():
    assert launch(2, ["-c", "pass"]) == 0


def test_the_callers_signal_handlers_come_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    launch(1, ["-c", "pass"])
    assert {s: signal.getsignal(s) for s in before} == before


def test_disaggregated_launch_checks_its_counts(capsys):
    from jaxserve.__main__ import main
    from jaxserve.launch import launch_disaggregated

    with pytest.raises(ValueError, match="^decode must be positive"):
        launch_disaggregated(1, 0, ["scripts/serve.py"])
    with pytest.raises(SystemExit):
        main(["launch", "--prefill", "1", "--", "scripts/serve.py"])
    assert "give --num-processes, or --prefill and --decode" in capsys.readouterr().err
    with pytest.raises(ValueError, match="^devices_per_engine must be positive"):
        launch_disaggregated(1, 1, ["scripts/serve.py"], devices_per_engine=0)


def test_each_engine_gets_devices_of_its_own():
    from jaxserve.launch import engine_devices

    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=x"}
    envs = [engine_devices(base, i, 2) for i in range(3)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3", "4,5"]
    assert all(e["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=2"
               for e in envs)
    some = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # runs of the GPUs already visible
    assert [engine_devices(some, i, 2)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == [
        "4,5", "6,7"]
    with pytest.raises(ValueError, match="engine 2 needs 2 GPUs past the first 4 of "
                                         "CUDA_VISIBLE_DEVICES=4,5,6,7$"):
        engine_devices(some, 2, 2)


def test_every_launched_process_gets_the_api_key_through_its_environment(capfd):
    """Whatever the launcher starts (the processes of one engine, a front and its engines),
    an --api-key in the command reaches it as JAXSERVE_API_KEY, not in its argv."""
    from jaxserve.launch import launch_disaggregated

    child = ("import os, sys; print('argv', sys.argv[1:], 'key', "
             "os.environ.get('JAXSERVE_API_KEY'), flush=True)")
    assert launch(2, ["-c", child, "--api-key=s3cret", "--port", "1"]) == 0
    assert launch_disaggregated(1, 1, ["-c", child, "--api-key", "s3cret"]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert len(lines) == 5, lines  # two processes, then two engines and the front
    for line in lines:
        argv, key = line.removeprefix("argv ").split(" key ")
        assert key == "s3cret" and "s3cret" not in argv and "--api-key" not in argv, line


def test_each_disaggregated_launch_hands_its_processes_a_fresh_secret(capfd):
    """The same secret to every process, in its environment and never on a command line (any
    local user can read those); another launch, another secret."""
    from jaxserve.launch import launch_disaggregated
    from jaxserve.serving.engine_secret import ENV

    child = f"import os, sys; print('child', os.environ['{ENV}'], *sys.argv[1:])"
    seen = []
    for _ in range(2):
        assert launch_disaggregated(1, 1, ["-c", child]) == 0
        lines = [ln.split() for ln in capfd.readouterr().out.splitlines()
                 if ln.startswith("child ")]
        assert len(lines) == 3 and len({ln[1] for ln in lines}) == 1  # two engines, a front
        secret = lines[0][1]
        assert re.fullmatch(r"[0-9a-f]{64}", secret)
        assert not any(secret in " ".join(ln[2:]) for ln in lines)
        seen.append(secret)
    assert seen[0] != seen[1] and ENV not in os.environ
