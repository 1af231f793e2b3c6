"""One decode step's inputs, built by hand for a runner: scripts/gpu_check.py times its program
and scripts/step_ops.py counts the operations it launches."""

from __future__ import annotations

import numpy as np

from jaxserve.kernels.attention.metadata import AttentionMetadata
from jaxserve.runtime.sampling import SamplingInputs
from jaxserve.runtime.step_inputs import StepInputs, empty_spec_inputs, seq_bucket


def decode_inputs(runner, b: int, ctx: int) -> StepInputs:
    """One greedy decode step of `b` sequences at position `ctx`, padded to the runner's
    buckets (each sequence on blocks of its own)."""
    tok, seq, blk = runner.buckets
    t = min(x for x in tok if x >= b)
    s = seq_bucket(seq, t)
    mb = min(x for x in blk if x * runner.block_size > ctx)
    tables = np.zeros((s, mb), np.int32)
    tables[:b] = np.arange(b * mb, dtype=np.int32).reshape(b, mb) % runner.num_blocks
    pos, tseq = np.zeros(t, np.int32), np.zeros(t, np.int32)
    pos[:b], tseq[:b] = ctx, np.arange(b)
    slots = np.full(t, runner.num_blocks * runner.block_size, np.int32)
    slots[:b] = tables[:b, ctx // runner.block_size] * runner.block_size + ctx % runner.block_size
    qsl = np.full(s + 1, b, np.int32)
    qsl[:b] = np.arange(b)
    ctx_lens = np.zeros(s, np.int32)
    ctx_lens[:b] = ctx + 1
    return StepInputs(
        input_ids=np.ones(t, np.int32), prev_rows=np.full(t, -1, np.int32),
        attn=AttentionMetadata(pos, tseq, slots, tables, ctx_lens, qsl),
        logits_indices=np.arange(s, dtype=np.int32) % b,
        prompt_targets=np.full(t, -1, np.int32),
        sampling=SamplingInputs(np.zeros(s, np.float32), np.ones(s, np.float32),
                                np.zeros(s, np.int32), np.zeros(s, np.uint32),
                                np.zeros(s, np.int32), np.arange(s) < b, np.bool_(False)),
        processing=runner.logits_shape.unused(s),
        spec=empty_spec_inputs(s, runner.config.spec_tokens, runner.logits_shape.mask_words),
        plain=runner.plain_programs)  # greedy rows: the program the engine runs for them
