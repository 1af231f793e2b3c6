"""A request handed over from a prefill engine to a decode engine in one process: the same
greedy tokens as one colocated engine, prompt blocks the decode side holds are not sent, a
decode engine without room refuses and holds nothing, and every block comes back."""

from __future__ import annotations

import itertools

import pytest

from jaxserve import EngineConfig, SamplingParams
from jaxserve.engine.handover import NoRoom
from jaxserve.runtime.kv_cache import bytes_per_block
from tests.helpers import make_engine, run_all

SYSTEM = [(7 * i) % 400 + 3 for i in range(40)]  # a shared "system prompt": 5 full blocks
PROMPTS = {f"u{i}": SYSTEM + [10 + i, 20 + i, 30 + i] for i in range(3)} | {
    "other": [9, 8, 7, 6, 5]}
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = dict(block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
_uuids = itertools.count(1)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return {role: make_engine(tiny_llama_dir, role=role, **SMALL)
            for role in ("both", "prefill", "decode")}


def _prefill(pre, prompts: dict) -> dict:
    for rid, ids in prompts.items():
        pre.add_request(rid, prompt_token_ids=ids, params=PARAMS)
    firsts = {}
    while len(firsts) < len(prompts):
        for out in pre.step():
            assert not out.finished, out  # it waits for its handover
            firsts[out.request_id] = out.outputs[0].token_ids
    return firsts


def _hand_over(pre, dec, rid: str, first: list[int]):
    r = dec.handover.reserve(rid, PROMPTS[rid.split("-")[-1]], PARAMS, first[0])
    uuid = next(_uuids)
    nbytes = pre.handover.offer(rid, r.first_block, r.num_blocks, uuid, 30)
    arrays = dec.handover.pull(pre.handover.address, uuid, r.num_blocks, 30)
    assert pre.handover.release(rid)
    assert dec.handover.install(rid, arrays, nbytes, 0.0)
    return r, nbytes


def test_tokens_equal_colocated_and_cached_blocks_are_not_sent(engines):
    both, pre, dec = engines["both"], engines["prefill"], engines["decode"]
    for rid, ids in PROMPTS.items():
        both.add_request(rid, prompt_token_ids=ids, params=PARAMS)
    want = {r: o.outputs[0].token_ids for r, o in run_all(both).items()}
    got, sent = {}, {}
    for wave in ("a", "b"):  # the second wave finds the system prompt on the decode side
        prompts = {f"{wave}-{r}": ids for r, ids in PROMPTS.items()}
        for rid, first in _prefill(pre, prompts).items():
            r, nbytes = _hand_over(pre, dec, rid, first)
            sent[rid] = r.first_block, r.num_blocks
            assert nbytes == r.num_blocks * bytes_per_block(
                dec.model_config, 8, dec.runner.kv_dtype)
        released = pre.take_pending_outputs()
        assert sorted(o.outputs[0].finish_reason for o in released) == ["handover"] * 4
        got |= {r: o.outputs[0].token_ids for r, o in run_all(dec).items()}
    assert got == {f"{w}-{r}": t for w in "ab" for r, t in want.items()}
    assert sent["a-u0"] == (0, 6)  # 43 tokens: 5 full blocks and a partial one
    assert sent["a-u1"][0] == 5  # the system prompt's blocks came with a-u0
    assert sent["b-u0"] == (5, 1)  # only the partial last block moves again
    for e in (pre, dec):
        assert e.block_manager.num_used_blocks == 0 and not e.requests
        e.block_manager.check_integrity([])
    snap = dec.metrics_snapshot()
    assert snap["handover_installed"] == 8 and snap["handover_blocks_cached"] == 5 * 5
    assert snap["handover_bytes"] == snap["handover_blocks_pulled"] * bytes_per_block(
        dec.model_config, 8, dec.runner.kv_dtype)


def test_a_decode_engine_without_room_refuses_and_holds_nothing(tiny_llama_dir):
    dec = make_engine(tiny_llama_dir, role="decode", num_kv_blocks=8, **SMALL)
    dec.handover.reserve("w", PROMPTS["u0"], SamplingParams(max_tokens=4), 5)
    with pytest.raises(NoRoom, match="6 free KV blocks"):
        dec.handover.reserve("x", PROMPTS["other"] + SYSTEM, SamplingParams(max_tokens=4), 5)
    assert list(dec.requests) == ["w"] and dec.block_manager.num_used_blocks == 6
    assert dec.metrics_snapshot()["handover_refused"] == 1
    assert dec.abort("w") and dec.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="^first_token"):
        dec.handover.reserve("y", [1, 2], SamplingParams(max_tokens=4), 10**6)
    with pytest.raises(ValueError, match="^n:"):
        dec.handover.reserve("z", [1, 2], SamplingParams(max_tokens=4, n=2), 5)
    assert not dec.requests


def test_aborts_while_parked_or_receiving_return_every_block(engines):
    pre, dec = engines["prefill"], engines["decode"]
    first = _prefill(pre, {"c-u2": PROMPTS["u2"]})["c-u2"]
    assert pre.block_manager.num_used_blocks == 6
    dec.handover.reserve("c-u2", PROMPTS["u2"], PARAMS, first[0])
    assert dec.block_manager.num_used_blocks == 6
    assert pre.abort("c-u2") and dec.abort("c-u2")
    assert not dec.handover.install("c-u2", [], 0, 0.0)  # K/V arriving late is dropped
    for e in (pre, dec):
        (out,) = e.take_pending_outputs()
        assert out.finished and out.outputs[0].finish_reason == "abort"
        assert e.block_manager.num_used_blocks == 0 and not e.handover.num_held
        e.block_manager.check_integrity([])


def test_role_is_checked():
    with pytest.raises(ValueError, match="^role must be one of both, prefill, decode"):
        EngineConfig(role="middle")


@pytest.mark.parametrize("tp_prefill,tp_decode", [(2, 1), (1, 4), (4, 2)])
def test_engines_of_any_tensor_parallel_size_hand_over(engines, tiny_llama_dir, tp_prefill,
                                                       tp_decode):
    """Blocks travel in the model's own kv heads: a prefill engine splitting them over 2
    devices hands over to one on a single device, one on a single device to one replicating
    each kv head over 4, and one replicating them to one splitting them over 2. Greedy tokens
    equal the colocated engine's; the bytes sent are those of the model's heads; every block
    comes back on both sides."""
    both = engines["both"]
    for rid, ids in PROMPTS.items():
        both.add_request(rid, prompt_token_ids=ids, params=PARAMS)
    want = {r: o.outputs[0].token_ids for r, o in run_all(both).items()}
    pre, dec = (make_engine(tiny_llama_dir, role=role, tensor_parallel_size=tp, **SMALL)
                for role, tp in (("prefill", tp_prefill), ("decode", tp_decode)))
    assert dec.runner.model_config.num_kv_heads == max(2, tp_decode)  # replicated at tp 4
    prompts = {f"tp-{r}": ids for r, ids in PROMPTS.items()}
    for rid, first in _prefill(pre, prompts).items():
        r, nbytes = _hand_over(pre, dec, rid, first)
        assert nbytes == r.num_blocks * bytes_per_block(both.model_config, 8,
                                                        dec.runner.kv_dtype)
    pre.take_pending_outputs()
    got = {r: o.outputs[0].token_ids for r, o in run_all(dec).items()}
    assert got == {f"tp-{r}": t for r, t in want.items()}
    for e in (pre, dec):
        assert e.block_manager.num_used_blocks == 0 and not e.requests
        e.block_manager.check_integrity([])
    assert dec.runner.kv.k.sharding == dec.runner.kv.v.sharding  # still laid out as it was
    if tp_decode > 1:
        assert len(dec.runner.kv.k.sharding.device_set) == tp_decode


def test_blocks_in_the_decode_sides_host_tier_are_copied_in_not_sent(engines, tiny_llama_dir):
    """A decode engine whose small pool evicted the system prompt's blocks to its prefix
    cache's host tier takes them back from there at the next handover: only the blocks past
    them are pulled, the tokens equal the colocated engine's, and every block comes back."""
    both, pre = engines["both"], engines["prefill"]
    dec = make_engine(tiny_llama_dir, role="decode", num_kv_blocks=12, max_model_len=96,
                      **SMALL)
    PROMPTS["filler"] = [(11 * i) % 500 + 1 for i in range(80)]  # 10 blocks: evicts them
    order = ["h1-u0", "f-filler", "h2-u1"]
    try:
        for rid in ("u0", "filler", "u1"):
            both.add_request(rid, prompt_token_ids=PROMPTS[rid], params=PARAMS)
        want = {r: o.outputs[0].token_ids for r, o in run_all(both).items()}
        sent, got = {}, {}
        for rid in order:  # one at a time: each finishes before the next
            first = _prefill(pre, {rid: PROMPTS[rid.split("-")[1]]})[rid]
            r, _ = _hand_over(pre, dec, rid, first)
            sent[rid] = r.first_block, r.num_blocks
            pre.take_pending_outputs()
            got |= {k: o.outputs[0].token_ids for k, o in run_all(dec).items()}
    finally:
        del PROMPTS["filler"]
    assert got == {rid: want[rid.split("-")[1]] for rid in order}
    assert sent["h1-u0"] == (0, 6)
    assert sent["h2-u1"] == (5, 1)  # the system prompt's 5 blocks were found, not sent
    snap = dec.metrics_snapshot()
    assert snap["prefix_cache_host_hits"] >= 8 * 3  # at least 3 of them from the host tier
    assert snap["handover_blocks_cached"] == 5
    assert dec.block_manager.num_used_blocks == 0 and not dec.requests
    dec.block_manager.check_integrity([])
