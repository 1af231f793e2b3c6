"""The shared post-step loop on the host: progress, several tokens per row, stop rules."""

from __future__ import annotations

import numpy as np

from jaxserve import SamplingParams
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.scheduler import Scheduler, SchedulerConfig
from jaxserve.core.sequence import Sequence
from jaxserve.engine.detokenizer import IncrementalDetokenizer, TokenDecoder
from jaxserve.engine.postprocess import Postprocessor, SeqUpdate


def setup(**params):
    sched = Scheduler(SchedulerConfig(4, 64, 32), BlockManager(16, 4))
    seq = Sequence("r", [1, 2, 3], SamplingParams(**params), 0, 0)
    sched.add(seq)
    return sched, seq, Postprocessor(sched, max_model_len=32, eos_token_ids=frozenset({2}))


def test_rows_of_several_tokens_stop_at_the_first_stop_and_return_blocks():
    sched, seq, post = setup(max_tokens=10, stop_token_ids=[7])
    out = sched.schedule()
    (u,) = post.apply(out.scheduled, [[5, 7, 9]], now=1.0)
    assert seq.num_computed_tokens == 3
    assert u.new_token_ids == [5, 7] and u.finished  # 9 came after the stop: dropped
    assert (seq.finish_reason, seq.stop_reason) == ("stop", 7)
    assert seq.metrics.token_times == [1.0, 1.0] and seq.metrics.finished_time == 1.0
    assert sched.block_manager.num_free_blocks == 16 and not sched.running


def test_length_eos_and_rows_without_tokens():
    sched, seq, post = setup(max_tokens=2)
    out = sched.schedule()
    assert post.apply(out.scheduled, [[]], now=0.0) == []  # a chunk that samples nothing
    (u,) = post.apply(out.scheduled, [[4, 6]], now=0.0)
    assert u.finished and seq.finish_reason == "length" and seq.output_token_ids == [4, 6]
    sched, seq, post = setup(max_tokens=5)
    (u,) = post.apply(sched.schedule().scheduled, [[2]], now=0.0)
    assert u.finished and seq.finish_reason == "stop" and seq.stop_reason is None
    sched, seq, post = setup(max_tokens=5, ignore_eos=True)
    (u,) = post.apply(sched.schedule().scheduled, [[2]], now=0.0)
    assert not u.finished


def test_rows_taken_whole_match_token_by_token(smollm):
    """A row without per-token asks, taken whole (Postprocessor._extend) or, of one token,
    by _append_one, ends exactly as the rules applied token by token (_append) do: tokens
    kept, text, stop reason, counts."""
    decoder = TokenDecoder(smollm.tokenizer)
    rng = np.random.default_rng(0)
    words = smollm.tokenizer.encode("Hé, ça marche? 東京 🚀 done.", add_special_tokens=False)
    eos = frozenset({2, int(words[-2])})  # one with text of its own, which EOS never adds
    for case in range(300):
        params = dict(max_tokens=int(rng.integers(1, 12)), ignore_eos=bool(rng.random() < 0.3),
                      stop_token_ids=[int(words[1])] if rng.random() < 0.3 else None)
        size = 1 if rng.random() < 0.4 else int(rng.integers(2, 9))
        row = [int(t) for t in rng.choice([*words, 2], size=size)]
        pending = int(rng.integers(0, len(row) + 1))
        ends = []
        for way in ("append", "extend", "one") if len(row) == 1 else ("append", "extend"):
            sched, seq, post = setup(**params)
            post.eos_token_ids = eos
            sched.schedule()
            seq.add_pending(pending)
            seq.detok = IncrementalDetokenizer(decoder, seq.prompt_token_ids)
            update = SeqUpdate(seq, [], "", False)
            if way == "extend":
                post._extend(seq, row, 1.0, update)
            elif way == "one":
                update.new_token_ids.append(row[0])
                update.new_text, update.finished = post._append_one(seq, row[0], 1.0)
            else:
                for token in row:
                    post._append(seq, token, 1.0, None, update)
                    if update.finished:
                        break
            ends.append((update.new_token_ids, update.new_text, update.finished,
                         seq.output_token_ids, seq.text, seq.finish_reason,
                         seq.stop_reason, seq.num_tokens, seq.num_pending,
                         seq.metrics.token_times, sched.block_manager.num_free_blocks))
        assert all(end == ends[0] for end in ends), (case, params, row, pending)
