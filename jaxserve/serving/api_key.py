"""Where the server's API key comes from: `--api-key KEY`, the first line of `--api-key-file
PATH`, or the JAXSERVE_API_KEY environment variable, in that order (one of the two flags).

A flag's value sits in the process's command line, which any local user reads with `ps`; a
file or the environment keeps it out. A launcher hands an `--api-key` it was given on to the
processes it starts through the environment for the same reason.
"""

from __future__ import annotations

import os

ENV = "JAXSERVE_API_KEY"
FLAG = "--api-key"
FILE_FLAG = "--api-key-file"


def add_file_option(parser) -> None:
    parser.add_argument(FILE_FLAG, default=None, metavar="PATH",
                        help=f"read the API key from this file's first line (or set {ENV}): "
                             f"unlike {FLAG}, it stays out of the process list")


def resolve(key: str | None, path: str | None, environ=None) -> str | None:
    """The key: `key` (--api-key), else the first line of `path` (--api-key-file) stripped,
    else $JAXSERVE_API_KEY, else None. ValueError naming the option when both flags are given
    or the file gives no key."""
    if key is not None and path is not None:
        raise ValueError(f"api_key: give {FLAG} or {FILE_FLAG}, not both")
    if key is not None:
        return key
    if path is None:
        return (os.environ if environ is None else environ).get(ENV) or None
    try:
        with open(path) as f:
            key = f.readline().strip()
    except OSError as e:
        raise ValueError(f"api_key_file: cannot read {path}: {e.strerror}") from None
    if not key:
        raise ValueError(f"api_key_file: {path} holds no key on its first line")
    return key


def to_environment(command: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """`command` without its `--api-key KEY` (or `--api-key=KEY`), and `env` with that key as
    $JAXSERVE_API_KEY: what a launcher runs instead, the key out of the child's argv.
    ValueError if `command` gives --api-key-file too."""
    argv, key, args = [], None, iter(command)
    for arg in args:
        if arg == FLAG:
            key = next(args, None)
        elif arg.startswith(FLAG + "="):
            key = arg[len(FLAG) + 1:]
        else:
            argv.append(arg)
    if key is None:
        return command, env
    if any(a == FILE_FLAG or a.startswith(FILE_FLAG + "=") for a in argv):
        raise ValueError(f"api_key: give {FLAG} or {FILE_FLAG}, not both")
    return argv, {**env, ENV: key}
