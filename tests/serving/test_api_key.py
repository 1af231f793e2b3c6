"""The API key's sources (--api-key, --api-key-file, JAXSERVE_API_KEY) and how a launcher hands
the flag on through the environment instead of argv."""

from __future__ import annotations

import pytest

from jaxserve.serving.api_key import ENV, resolve, to_environment


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "key"
    path.write_text("  from-file \nsecond line\n")
    return str(path)


def test_the_flag_beats_the_environment(key_file):
    env = {ENV: "from-env"}
    assert resolve("from-flag", None, env) == "from-flag"
    assert resolve(None, key_file, env) == "from-file"  # the first line, stripped
    assert resolve(None, None, env) == "from-env"
    assert resolve(None, None, {}) is None
    assert resolve(None, None, {ENV: ""}) is None  # set but empty: no key


def test_both_flags_or_a_file_without_a_key_are_refused(key_file, tmp_path):
    with pytest.raises(ValueError, match="^api_key: give --api-key or --api-key-file, not both"):
        resolve("k", key_file, {})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="^api_key_file: .*empty holds no key on its first"):
        resolve(None, str(empty), {ENV: "from-env"})
    with pytest.raises(ValueError, match="^api_key_file: cannot read .*missing"):
        resolve(None, str(tmp_path / "missing"), {})


@pytest.mark.parametrize("command", [
    ["serve.py", "--port", "1", "--api-key", "s3cret", "--http-port", "0"],
    ["serve.py", "--port", "1", "--api-key=s3cret", "--http-port", "0"],
])
def test_a_launcher_moves_the_key_from_argv_to_the_environment(command):
    argv, env = to_environment(command, {"PATH": "x", ENV: "older"})
    assert argv == ["serve.py", "--port", "1", "--http-port", "0"]
    assert env == {"PATH": "x", ENV: "s3cret"}  # the flag beats what the environment held


def test_a_command_without_the_flag_is_handed_on_as_it_is():
    command, env = ["serve.py", "--api-key-file", "key.txt", "--port", "1"], {ENV: "e"}
    assert to_environment(command, env) == (command, env)


def test_a_launcher_refuses_both_flag_forms():
    with pytest.raises(ValueError, match="not both"):
        to_environment(["serve.py", "--api-key", "a", "--api-key-file", "f"], {})
