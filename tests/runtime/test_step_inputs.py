"""Step inputs built on the host: token rows, slots, tables, sampling fields, bucket padding."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.core.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.core.sequence import PENDING, Sequence
from jaxserve.engine.logits_state import LogitsState
from jaxserve.models.loader import load_model
from jaxserve.runtime.logits_processing import LogitsShape
from jaxserve.runtime.runner import ModelRunner
from jaxserve.runtime.step_inputs import (
    build_step_inputs,
    dummy_step_inputs,
    pick_bucket,
    seq_bucket,
)

BUCKETS = ((8, 16, 32), (2, 4), (2, 4))
BLOCK = 4
POOL = 20
SHAPE = LogitsShape(vocab_size=100, history=32)


def seq(rid, prompt, out=(), blocks=(), computed=0, **params) -> Sequence:
    s = Sequence(rid, list(prompt), SamplingParams(**params), 0, seed=7)
    for t in out:
        s.append_token(t)
    s.block_table = list(blocks)
    s.num_computed_tokens = computed
    return s


def test_mixed_prefill_chunk_and_decode():
    # a: a prompt of 6 in its first chunk of 5 (slots in blocks 3, 9); b: decoding its 7th token.
    a = seq("a", [11, 12, 13, 14, 15, 16], blocks=[3, 9], temperature=0)
    b = seq("b", [21, 22, 23, 24, 25, 26], out=[27], blocks=[5, 2], computed=6,
            temperature=0.5, top_p=0.9, top_k=3)
    sched = [ScheduledSeq.of(a, 5), ScheduledSeq.of(b, 1)]
    assert [s.samples for s in sched] == [False, True]
    inp = build_step_inputs(sched, BUCKETS, BLOCK, POOL, SHAPE)
    assert inp.bucket == (8, 4, 2)  # 8 token rows can hold 4 sequences: S pads to 4
    md = inp.attn
    np.testing.assert_array_equal(inp.input_ids, [11, 12, 13, 14, 15, 27, 0, 0])
    np.testing.assert_array_equal(md.positions[:6], [0, 1, 2, 3, 4, 6])
    np.testing.assert_array_equal(md.token_seq[:6], [0, 0, 0, 0, 0, 1])
    # slot = block * B + offset; padding rows point past the pool so their writes are dropped
    np.testing.assert_array_equal(md.slot_mapping, [12, 13, 14, 15, 36, 10, 80, 80])
    np.testing.assert_array_equal(md.block_tables, [[3, 9], [5, 2], [0, 0], [0, 0]])
    np.testing.assert_array_equal(md.context_lens, [5, 7, 0, 0])
    np.testing.assert_array_equal(md.query_start_loc, [0, 5, 6, 6, 6])
    np.testing.assert_array_equal(inp.logits_indices[:2], [4, 5])
    sp = inp.sampling
    np.testing.assert_allclose(sp.temperature[:2], [0, 0.5])
    np.testing.assert_allclose(sp.top_p[:2], [1, 0.9])
    np.testing.assert_array_equal(sp.top_k[:2], [0, 3])
    np.testing.assert_array_equal(sp.seeds[:2], [7, 7])
    np.testing.assert_array_equal(sp.steps[:2], [0, 1])
    np.testing.assert_array_equal(sp.samples, [False, True, False, False])
    assert not sp.want_logprobs  # nobody asked: the step skips the log-softmax


def test_the_sequence_bucket_follows_the_token_bucket():
    # a step of T padded rows holds at most min(T, max_num_seqs) sequences
    assert [seq_bucket((8, 16, 64), t) for t in (8, 16, 32, 512)] == [8, 16, 64, 64]
    assert seq_bucket((2, 4), 2) == 2
    # with 8 decode slots and held prefills up to 64: a step within the slots pads as before,
    # one with more sequences to the last bucket
    assert [seq_bucket((8, 16, 64), t, 8, 8) for t in (8, 16, 512)] == [8, 8, 8]
    assert [seq_bucket((8, 16, 64), t, 9, 8) for t in (16, 32, 512)] == [16, 64, 64]
    a = seq("a", [1, 2, 3], blocks=[0], temperature=0, logprobs=2)
    inp = build_step_inputs([ScheduledSeq.of(a, 3)], BUCKETS, BLOCK, POOL, SHAPE)
    assert inp.sampling.want_logprobs


def test_padding_sequences_and_blocks_take_the_next_bucket():
    seqs = [seq(f"s{i}", [5, 6, 7], blocks=[i], temperature=0) for i in range(3)]
    inp = build_step_inputs([ScheduledSeq.of(s, 3) for s in seqs], BUCKETS, BLOCK, POOL, SHAPE)
    assert inp.bucket == (16, 4, 2)
    md = inp.attn
    np.testing.assert_array_equal(md.query_start_loc, [0, 3, 6, 9, 9])  # padding seq: empty
    np.testing.assert_array_equal(md.context_lens, [3, 3, 3, 0])
    assert not inp.sampling.samples[3]
    assert (md.slot_mapping[9:] == POOL * BLOCK).all()


def test_a_step_beyond_the_largest_bucket_is_refused():
    with pytest.raises(ValueError, match="tokens in step 33 exceeds the largest bucket 32"):
        pick_bucket(BUCKETS[0], 33, "tokens in step")


def test_dummy_inputs_have_the_bucket_shape():
    assert dummy_step_inputs(16, 4, 2, BLOCK, POOL, SHAPE).bucket == (16, 4, 2)


@pytest.mark.parametrize("params, plain", [
    (dict(temperature=0), True),
    (dict(temperature=0.7, seed=3), True),
    (dict(temperature=0.7, top_p=0.9), False),
    (dict(temperature=0.7, top_k=5), False),
    (dict(temperature=0, top_k=5), True),  # a greedy row's top-k changes nothing
    (dict(temperature=0.7, min_p=0.1), False),
    (dict(temperature=0, logprobs=2), False),
    (dict(temperature=0, presence_penalty=0.5), False),
])
def test_plain_steps_are_those_without_branches_to_take(params, plain):
    """A decode step beside a greedy one is plain exactly when its row asks nothing the plain
    program leaves out; a runner without plain programs never gets one."""
    a = seq("a", [1, 2, 3], out=[4], blocks=[0], computed=3, temperature=0)
    b = seq("b", [5, 6, 7], out=[8], blocks=[1], computed=3, **params)
    if b.params.processes_logits:  # as the engine builds it for such a request
        b.logits_state = LogitsState(b.params, b.prompt_token_ids, SHAPE.vocab_size, (), [])
    sched = [ScheduledSeq.of(a, 1), ScheduledSeq.of(b, 1)]
    inp = build_step_inputs(sched, BUCKETS, BLOCK, POOL, SHAPE, plain_programs=True)
    assert inp.plain is plain and inp.program.plain is plain
    assert not build_step_inputs(sched, BUCKETS, BLOCK, POOL, SHAPE).plain


def test_layer_groups_give_a_table_and_a_slot_per_group():
    """With layer groups (core/kv_layout.py) each group's table is its own and so is each
    row's slot; the constants come from group 0's rows; the dummy inputs have the shapes."""
    a = seq("a", [11, 12, 13, 14, 15, 16], blocks=[3, 9], temperature=0)
    b = seq("b", [21, 22, 23, 24, 25, 26], out=[27], blocks=[5, 2], computed=6,
            temperature=0.5)
    a.group_tables, b.group_tables = [[7, 8]], [[0, 4]]  # b's first block dropped: page 0
    sched = [ScheduledSeq.of(a, 5), ScheduledSeq.of(b, 1)]
    inp = build_step_inputs(sched, BUCKETS, BLOCK, POOL, SHAPE, num_groups=2)
    md = inp.attn
    assert inp.bucket == (8, 4, 2)
    np.testing.assert_array_equal(md.block_tables[:, :2], [[[3, 9], [5, 2]], [[7, 8], [0, 4]]])
    np.testing.assert_array_equal(md.slot_mapping, [[12, 13, 14, 15, 36, 10, 80, 80],
                                                    [28, 29, 30, 31, 32, 18, 80, 80]])
    np.testing.assert_allclose(inp.sampling.temperature[:2], [0, 0.5])
    dummy = dummy_step_inputs(8, 4, 2, BLOCK, POOL, SHAPE, num_groups=2)
    assert dummy.attn.block_tables.shape == (2, 4, 2) and dummy.attn.slot_mapping.shape == (2, 8)
    assert dummy.bucket == (8, 4, 2)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    config = EngineConfig(model=tiny_llama_dir, max_num_seqs=4, max_num_batched_tokens=16,
                          max_model_len=64, num_kv_blocks=32, block_size=BLOCK, decode_steps=4,
                          swap_space_bytes=0).on_platform("cpu")
    return ModelRunner(config, load_model(tiny_llama_dir))


def test_the_runner_prepares_its_step_from_the_schedulers_output(runner):
    """The step takes the runner's buckets, pool and rows kept between steps; a decode whose
    token is still on the device reads the in-flight step's row; every step is one of the
    programs warmup compiles."""
    a = seq("a", [11, 12, 13, 14, 15, 16], blocks=[3, 9], temperature=0)
    b = seq("b", [21, 22, 23, 24, 25, 26], blocks=[5, 2], computed=6, temperature=0.5)
    b.output_token_ids.append(PENDING)  # sampled by the step still in flight, at its row 2
    inp = runner.prepare_step(SchedulerOutput([ScheduledSeq.of(a, 5), ScheduledSeq.of(b, 1)]),
                              {"b": 2})
    np.testing.assert_array_equal(inp.input_ids[:6], [11, 12, 13, 14, 15, 0])
    np.testing.assert_array_equal(inp.prev_rows[:7], [-1, -1, -1, -1, -1, 2, -1])
    assert (inp.attn.slot_mapping[6:] == runner.num_blocks * BLOCK).all()
    np.testing.assert_allclose(inp.sampling.temperature[:2], [0, 0.5])
    assert inp.decode is None and inp.program in runner.all_programs()

    rows = runner.step_rows
    b.output_token_ids[-1] = 27
    b.block_table.append(7)  # grown in place: the kept row copies the new entry
    c = seq("c", [1, 2, 3], out=[4], blocks=[6], computed=3, temperature=0)
    loop = SchedulerOutput([ScheduledSeq.of(b, 1), ScheduledSeq.of(c, 1)], decode_steps=4)
    inp = runner.prepare_step(loop)
    assert runner.step_rows is rows
    np.testing.assert_array_equal(inp.input_ids[:2], [27, 4])
    np.testing.assert_array_equal(inp.attn.block_tables[:2, :3], [[5, 2, 7], [6, 0, 0]])
    assert inp.decode.num_steps == 4 and inp.program in runner.all_programs()


def test_a_sequence_alone_is_prepared_on_rows_of_its_own(runner):
    """After a step fails to build, each sequence is tried alone: one whose value does not fit
    the step's arrays fails on its own, and the rows kept for the steps are not touched."""
    good = seq("good", [1, 2, 3], out=[4], blocks=[1], computed=3, temperature=0)
    bad = seq("bad", [1, 2, 3], out=[4], blocks=[2], computed=3, temperature=0.5,
              top_k=2**40)
    other = seq("other", [1, 2, 3], out=[4], blocks=[8, 9], computed=3, temperature=0)
    runner.prepare_step(SchedulerOutput([ScheduledSeq.of(other, 1)]))
    with pytest.raises(OverflowError):
        runner.prepare_step(SchedulerOutput([ScheduledSeq.of(good, 1), ScheduledSeq.of(bad, 1)]))
    kept = runner.step_rows.rows.copy()
    assert [8, 9] in kept[:, :2].tolist()
    assert runner.prepare_alone(ScheduledSeq.of(good, 1)).input_ids[0] == 4
    with pytest.raises(OverflowError):
        runner.prepare_alone(ScheduledSeq.of(bad, 1))
    good.output_token_ids.append(PENDING)  # alone, a pending token reads row 0
    alone = runner.prepare_alone(ScheduledSeq(good, 4, 1, True, False))
    assert alone.prev_rows[0] == 0 and alone.bucket[1] == 1
    np.testing.assert_array_equal(runner.step_rows.rows, kept)
