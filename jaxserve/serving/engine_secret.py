"""The engines' secret: what opens the doors of the prefill and decode engines of disaggregated
serving (serving/disagg.py) to their front, and to no other process.

`python -m jaxserve launch --prefill N --decode M` makes a fresh random secret for each launch
and hands it to the engines and the front in their environment (ENV), never on a command line,
which any local user can read; processes started by hand get the same value there. The secret
never crosses a socket:

- An engine with the secret sends a challenge first on each connection and takes no frame until
  the peer answers with a proof: an HMAC of the secret over both sides' nonces. Any other first
  frame, or a wrong proof, is logged and the connection closed. The engine proves itself back
  the same way, so a front never sends a prompt to a process that took an engine's port.
- A handover's K/V waits on the prefill engine's transfer server (runtime/kv_transfer.py), which
  any process can reach, under a number it derives from the offer's random name with the secret:
  knowing a name, or many, does not let a stranger pull the blocks.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import MutableMapping

ENV = "JAXSERVE_ENGINE_SECRET"
MIN_LENGTH = 32


def new() -> str:
    return secrets.token_hex(32)


def from_env(environ: MutableMapping[str, str] = os.environ) -> bytes | None:
    """The secret in ENV, taken out of `environ` so that no child process inherits it; None
    when unset. Raises ValueError for a value too short to be a secret."""
    value = environ.pop(ENV, None)
    if value is None:
        return None
    if len(value) < MIN_LENGTH:
        raise ValueError(f"{ENV}: give at least {MIN_LENGTH} characters (the launcher makes "
                         f"64 random hex digits), got {len(value)}")
    return value.encode()


def nonce() -> str:
    return secrets.token_hex(16)


def proof(secret: bytes, who: str, *nonces: str) -> str:
    """What `who` ("front" or "engine") sends to show it holds `secret`, for these nonces."""
    return hmac.new(secret, "\n".join((who, *nonces)).encode(), hashlib.sha256).hexdigest()


def is_proof(secret: bytes, claimed, who: str, *nonces: str) -> bool:
    return isinstance(claimed, str) and hmac.compare_digest(
        claimed.encode(), proof(secret, who, *nonces).encode())


def offer_name() -> str:
    """A fresh name for one handover's offer: random, so one name tells nothing of another."""
    return secrets.token_hex(16)


def transfer_uuid(secret: bytes | None, name: str) -> int:
    """The number the transfer server holds offer `name` under: 64 bits (its width) of an
    HMAC of the name, so that without the secret a name cannot be turned into it."""
    digest = hmac.new(secret or b"", b"kv-offer\n" + name.encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big")
