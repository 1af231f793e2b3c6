"""The decode loop's bookkeeping between its steps (runtime/decode_loop.py): positions, K/V
slots, context lengths, sampling steps, stop ids and limits. Its step here records what it is
given and "samples" a token made of the row and the position; tests/engine/test_decode_loop.py
runs the real model through it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.attention.metadata import AttentionMetadata
from jaxserve.runtime import decode_loop
from jaxserve.runtime.kv_cache import KVCache
from jaxserve.runtime.logits_processing import LogitsShape
from jaxserve.runtime.sampling import SamplerOutput, SamplingInputs

B, NUM_BLOCKS = 4, 16
DROP = B * NUM_BLOCKS  # a slot past the pool: the write is dropped


@pytest.mark.parametrize("early_exit", [True, False])
def test_rows_advance_until_their_limit_or_a_stop_id(early_exit):
    # Three decoding sequences and a padding one over four rows (the last one padding). The
    # first step computes positions 4, 8 and 1 (context lengths 5, 9 and 2).
    tables = np.asarray([[3, 7, 0], [1, 2, 5], [4, 6, 0], [0, 0, 0]], np.int32)
    md = AttentionMetadata(
        positions=np.asarray([4, 8, 1, 0], np.int32), token_seq=np.asarray([0, 1, 2, 0], np.int32),
        slot_mapping=np.asarray([7 * B, 5 * B, 4 * B + 1, DROP], np.int32), block_tables=tables,
        context_lens=np.asarray([5, 9, 2, 0], np.int32),
        query_start_loc=np.asarray([0, 1, 2, 3, 3], np.int32))
    si = SamplingInputs(temperature=np.zeros(4, np.float32), top_p=np.ones(4, np.float32),
                        top_k=np.zeros(4, np.int32), seeds=np.zeros(4, np.uint32),
                        steps=np.asarray([7, 0, 3, 0], np.int32),
                        samples=np.asarray([True, True, True, False]),
                        want_logprobs=np.bool_(False))
    stop_ids = np.full((4, 8), -1, np.int32)
    stop_ids[1, :2] = [999, 110]  # row 1 stops when it samples at position 10
    loop = decode_loop.DecodeLoopInputs(limit=np.asarray([3, 5, 4, 0], np.int32),
                                        stop_ids=stop_ids, num_steps=6)
    seen = []

    def step(kv, ids, md, si, li):
        seen.append({"ids": np.asarray(ids).tolist(), "pos": np.asarray(md.positions).tolist(),
                     "slot": np.asarray(md.slot_mapping).tolist(),
                     "ctx": np.asarray(md.context_lens).tolist(),
                     "steps": np.asarray(si.steps).tolist(),
                     "samples": np.asarray(si.samples).tolist()})
        token = 100 * jnp.arange(4, dtype=jnp.int32) + md.positions[jnp.arange(4)]
        zeros = jnp.zeros((4, 1), jnp.float32)
        return kv, SamplerOutput(token[:, None], si.samples.astype(jnp.int32), zeros,
                                 jnp.zeros((4, 1, 2), jnp.int32), jnp.zeros((4, 1, 2)))

    kv = KVCache(jnp.zeros((1, NUM_BLOCKS, B, 1, 1)), jnp.zeros((1, NUM_BLOCKS, B, 1, 1)))
    with jax.disable_jit():  # the loop runs in Python, so the step can record
        _, out = decode_loop.run(step, kv, jnp.asarray([11, 12, 13, 0]), md, si,
                                 LogitsShape(512, 16).unused(4), jnp.arange(4), loop, 2, 512,
                                 early_exit)
    # every row has stopped after 4 steps; without early exit the loop runs its 6, idle
    assert len(seen) == (4 if early_exit else 6)
    for s in seen[4:]:
        assert s["samples"] == [False] * 4 and s["slot"] == [DROP] * 4
    seen = seen[:4]
    assert [s["pos"] for s in seen] == [[4, 8, 1, 0], [5, 9, 2, 0], [6, 10, 3, 0],
                                        [6, 10, 4, 0]]  # rows 0 and 1 stopped: frozen
    assert [s["ctx"] for s in seen] == [[5, 9, 2, 0], [6, 10, 3, 0], [7, 11, 4, 0],
                                        [7, 11, 5, 0]]
    assert [s["slot"] for s in seen] == [
        [7 * B, 5 * B, 4 * B + 1, DROP], [7 * B + 1, 5 * B + 1, 4 * B + 2, DROP],
        [7 * B + 2, 5 * B + 2, 4 * B + 3, DROP], [DROP, DROP, 6 * B, DROP]]
    assert [s["ids"] for s in seen] == [[11, 12, 13, 0], [4, 108, 201, 0], [5, 109, 202, 0],
                                        [6, 110, 203, 0]]
    assert [s["steps"] for s in seen] == [[7 + j, j, 3 + j, j] for j in range(4)]
    assert [s["samples"] for s in seen][-1] == [False, False, True, False]
    counts = np.asarray(out.num_tokens).tolist()
    assert counts == [3, 3, 4, 0]
    tokens = np.asarray(out.tokens)
    assert [tokens[i, :n].tolist() for i, n in enumerate(counts)] == [
        [4, 5, 6], [108, 109, 110], [201, 202, 203, 204], []]
