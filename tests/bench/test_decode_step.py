"""decode_inputs: a hand-built decode step that the runner's own program for its bucket runs."""

from __future__ import annotations

import numpy as np

from jaxserve.bench.decode_step import decode_inputs
from tests.helpers import make_engine


def test_decode_inputs_run_in_the_runners_bucket_each_sequence_on_its_own_slot(
        tiny_llama_dir):
    runner = make_engine(tiny_llama_dir, max_num_seqs=4, max_num_batched_tokens=8,
                         max_model_len=64, num_kv_blocks=32, token_buckets=(4, 8),
                         seq_buckets=(4, 8), block_buckets=(4,), max_held_seqs=0).runner
    inp = decode_inputs(runner, 3, 20)
    slots = inp.attn.slot_mapping
    assert len(inp.input_ids) == 4 and len(set(slots[:3].tolist())) == 3
    assert (slots[:3] % runner.block_size == 20 % runner.block_size).all()
    assert (slots[3:] == runner.num_blocks * runner.block_size).all()  # padding writes nowhere
    out = runner.execute(inp)
    assert out.num_tokens.tolist()[:3] == [1, 1, 1]
    assert ((out.token_ids[:3, 0] >= 0) & (out.token_ids[:3, 0] < 512)).all()
    compiled = runner.num_compiles
    runner.execute(decode_inputs(runner, 4, 30))  # the same bucket: no new program
    assert runner.num_compiles == compiled and np.all(inp.attn.context_lens[:3] == 21)
