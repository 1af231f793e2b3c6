"""Several decode steps in one call of the step program (the host's side: Scheduler._run_ahead).

When every row of a step decodes, the program runs up to K decode steps in a loop on the
device. Each is a plain step's forward of one token per row, logit processing and sampling,
then the stop checks: a row stops at one of its stop ids (EOS unless ignore_eos, its
stop_token_ids) or at its limit (what max_tokens, max_model_len and the blocks the host
reserved allow). Between steps the loop advances each running row's position, K/V slot (from
its block table), context length, sampling step (a seeded row draws from its key at each
token's index, as single steps do) and penalty history. A row that stops samples nothing
more: its position freezes and its K/V writes are dropped, and the loop ends once every row
has stopped.

The tokens come back as (S, K) with a count per row, the layout of speculative decoding's
accepted tokens, so the host's one postprocess loop trims them at stop strings, detokenizes
and streams them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.scheduler import MAX_LOOP_STOP_IDS, ScheduledSeq
from jaxserve.kernels.attention.metadata import AttentionMetadata
from jaxserve.runtime import logits_processing
from jaxserve.runtime.kv_cache import KVCache
from jaxserve.runtime.logits_processing import LogitsInputs
from jaxserve.runtime.sampling import SamplerOutput, SamplingInputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeLoopInputs:
    limit: np.ndarray  # (S,) int32: most tokens row s samples in the call (padding: 0)
    stop_ids: np.ndarray  # (S, E) int32: the tokens that stop row s (unused: -1)
    num_steps: int = dataclasses.field(metadata={"static": True})  # K: decode steps at most


# (kv, input ids (T,), metadata, sampling, logit processing) -> (kv, each row's token (S, 1))
StepFn = Callable[[KVCache, jax.Array, AttentionMetadata, SamplingInputs, LogitsInputs],
                  tuple[KVCache, SamplerOutput]]


def build(scheduled: list[ScheduledSeq], s_pad: int, num_steps: int) -> DecodeLoopInputs:
    """The loop's inputs for a step of decodes (each with its num_steps and stop ids)."""
    limit = np.zeros(s_pad, np.int32)
    limit[:len(scheduled)] = [s.num_steps for s in scheduled]
    stop_ids = np.full((s_pad, MAX_LOOP_STOP_IDS), -1, np.int32)
    rows: dict[tuple[int, ...], list[int]] = {}  # most rows share a few lists (EOS alone)
    for i, s in enumerate(scheduled):
        rows.setdefault(s.seq.stop_ids, []).append(i)
    for ids, where in rows.items():
        if ids:
            stop_ids[where, :len(ids)] = ids
    return DecodeLoopInputs(limit, stop_ids, num_steps)


def run(step: StepFn, kv: KVCache, ids: jax.Array, md: AttentionMetadata, si: SamplingInputs,
        li: LogitsInputs, logits_indices: jax.Array, loop: DecodeLoopInputs, max_logprobs: int,
        vocab_size: int, early_exit: bool = True) -> tuple[KVCache, SamplerOutput]:
    """Up to K decode steps from a step's inputs (`ids` (T,): its input tokens;
    `logits_indices` (S,): each row's query row) -> (kv, up to K tokens per row).
    `early_exit`: end once every row has stopped; else always run K steps (stopped rows
    sample nothing), a loop of known length: on a GPU the host reads an open-ended loop's
    condition back at every step, waiting for the device each time."""
    md, si, li, loop = jax.tree.map(jnp.asarray, (md, si, li, loop))
    s, k = loop.limit.shape[0], loop.num_steps
    block_size = kv.k.shape[2]
    drop_slot = kv.k.shape[1] * block_size  # past the pool: the write is dropped
    rows = jnp.where(loop.limit > 0, logits_indices, ids.shape[0])  # (S,): T for padding
    seqs = jnp.arange(s)

    def one_step(carry):
        j, kv, ids, ctx, running, li, out = carry
        pos = jnp.maximum(ctx - 1, 0)  # (S,) the position each row computes
        # (..., S): with layer groups (core/kv_layout.py) a slot per group
        slot = (md.block_tables[..., seqs, pos // block_size] * block_size
                + pos % block_size)
        step_md = dataclasses.replace(
            md, positions=md.positions.at[rows].set(pos, mode="drop"),
            slot_mapping=md.slot_mapping.at[..., rows].set(
                jnp.where(running, slot, drop_slot), mode="drop"),
            context_lens=ctx)
        kv, got = step(kv, ids, step_md,
                       dataclasses.replace(si, steps=si.steps + j, samples=running), li)
        token = got.tokens[:, 0]
        li = logits_processing.count(li, token, running, vocab_size)
        n = out.num_tokens + running
        out = SamplerOutput(out.tokens.at[:, j].set(token), n,
                            out.logprobs.at[:, j].set(got.logprobs[:, 0]),
                            out.top_ids.at[:, j].set(got.top_ids[:, 0]),
                            out.top_logprobs.at[:, j].set(got.top_logprobs[:, 0]))
        running = running & (n < loop.limit) & ~jnp.any(loop.stop_ids == token[:, None], axis=1)
        return j + 1, kv, ids.at[rows].set(token, mode="drop"), ctx + running, running, li, out

    def more(carry):
        j, running = carry[0], carry[4]
        return (j < k) & jnp.any(running)

    empty = SamplerOutput(jnp.zeros((s, k), jnp.int32), jnp.zeros(s, jnp.int32),
                          jnp.zeros((s, k), jnp.float32),
                          jnp.zeros((s, k, max_logprobs), jnp.int32),
                          jnp.zeros((s, k, max_logprobs), jnp.float32))
    carry = (jnp.int32(0), kv, ids, md.context_lens, loop.limit > 0, li, empty)
    if early_exit:
        carry = jax.lax.while_loop(more, one_step, carry)
    else:
        carry = jax.lax.fori_loop(0, k, lambda _, c: one_step(c), carry)
    _, kv, _, _, _, _, out = carry
    return kv, out
