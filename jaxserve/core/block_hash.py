"""Content addresses of full KV blocks: a hash chain over token ids (host only, no jax).

Block i of a sequence is named by H(name of block i-1, its block_size token ids, salt). Two
sequences whose first k blocks have the same names hold the same tokens in them, at the same
positions, after the same prefix: the K/V computed for one is valid for the other. The salt (a
request's `cache_salt`) keeps tenants apart: equal tokens under different salts never match. The
adapter (`lora`: what names a LoRA adapter's weights) does the same for K/V computed under one:
it never matches another adapter's or the base model's.
BLAKE2b with a 16-byte digest makes a collision (or one built on purpose by another tenant)
out of reach, at about a microsecond per block.
"""

from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes
_ROOT = b"jaxserve-prefix-v1"
MAX_SALT_CHARS = 256


def check_salt(salt) -> None:
    """Raise ValueError unless `salt` is None or a usable cache_salt."""
    if salt is not None and (not isinstance(salt, str) or not salt
                             or len(salt) > MAX_SALT_CHARS):
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_SALT_CHARS} "
                         f"characters")


def hash_block(parent: BlockHash | None, token_ids, salt: str | None = None,
               lora: str | None = None) -> BlockHash:
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(b"\0salt\0" + salt.encode())
    if lora:
        h.update(b"\0lora\0" + lora.encode())
    return h.digest()


def extend_hashes(hashes: list[BlockHash], tokens, block_size: int,
                  salt: str | None = None, first: int = 0,
                  lora: str | None = None) -> list[BlockHash]:
    """Append to `hashes` (the names of a sequence's first len(hashes) blocks) the names of
    every further full block of `tokens`, the sequence's tokens from block `first` on
    (first <= len(hashes)); returns `hashes`."""
    for i in range(len(hashes) - first, len(tokens) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, tokens[i * block_size:(i + 1) * block_size], salt,
                                 lora))
    return hashes
