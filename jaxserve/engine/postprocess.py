"""Postprocess: what the host does with one step's sampled tokens (no jax).

When a step is launched, every scheduled sequence advances its computed tokens and marks the
tokens it samples as pending. When the step's tokens are back, each sequence appends them (up to
K per sequence: more than one when speculative decoding accepts proposals or the step runs
several decode steps), detokenizes them incrementally, records logprobs and timings, and
applies the stop rules: EOS (unless ignore_eos), a stop token id, a stop string (the text is
trimmed before it), max_tokens, max_model_len; tokens after a stop are dropped. A
sequence that stops is finished in the scheduler at once, so its blocks return before the next
schedule. The engine, the scheduler simulator and the host-overhead benchmark all step through
this one loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Seq

from jaxserve.core.scheduler import ScheduledSeq, Scheduler
from jaxserve.core.sequence import Sequence, SequenceStatus

# (row, index among the row's new tokens, how many top entries) -> {"logprob", "top"}
LogprobFn = Callable[[int, int, int], dict]


@dataclasses.dataclass(slots=True)
class SeqUpdate:
    """What one step added to a sequence that produced tokens."""

    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    finished: bool
    error: str | None = None  # this sequence's own postprocess raised: the engine fails it


class Postprocessor:
    def __init__(self, scheduler: Scheduler, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def apply(self, scheduled: list[ScheduledSeq], tokens: Seq[Seq[int]], now: float,
              logprobs: LogprobFn | None = None) -> list[SeqUpdate]:
        """A synchronous step: `launched` then `resolve`."""
        self.launched(scheduled)
        return self.resolve(scheduled, tokens, now, logprobs)

    def launched(self, scheduled: list[ScheduledSeq]) -> None:
        """The step is on the device: its tokens count as computed (full blocks join the prefix
        cache), and every row that samples has a token pending, so the next schedule can run
        before this step's tokens are back."""
        commit = self.scheduler.block_manager.commit
        for s in scheduled:
            seq = s.seq
            seq.num_computed_tokens = s.end
            commit(seq)
            if s.samples:
                seq.add_pending(s.num_steps)

    def resolve(self, scheduled: list[ScheduledSeq], tokens: Seq[Seq[int]], now: float,
                logprobs: LogprobFn | None = None) -> list[SeqUpdate]:
        """`tokens[i]`: the tokens row i sampled (empty for a prefill chunk that does not reach
        its prompt's end), a list the updates may keep. Sequences that finished meanwhile (a
        stop in the step before, an abort) are skipped: what was computed for them is
        dropped."""
        updates = []
        append, append_one, extend = self._append, self._append_one, self._extend
        finished = SequenceStatus.FINISHED
        for i, s in enumerate(scheduled):
            row = tokens[i]
            if not row:
                continue
            seq = s.seq
            if seq.status is finished:
                continue
            scored = logprobs is not None and seq.logprobs is not None
            if len(row) == 1 and s.num_steps == 1 and not (
                    scored or seq.logits_state is not None or seq.params.stop or s.drafts):
                try:  # the hot path: a decode row of one token that asks for nothing more
                    text, done = append_one(seq, row[0], now)
                    updates.append(SeqUpdate(seq, row, text, done))
                except Exception as e:  # noqa: BLE001 - one request's failure is its own
                    updates.append(SeqUpdate(seq, row, "", False, f"{type(e).__name__}: {e}"))
                continue
            update = SeqUpdate(seq, [], "", False)
            try:
                if scored or seq.logits_state is not None or seq.params.stop:
                    for j, token in enumerate(row):
                        entry = logprobs(i, j, seq.params.logprobs) if scored else None
                        append(seq, int(token), now, entry, update)
                        if update.finished:
                            break  # tokens after a stop are dropped
                else:  # several tokens, or one of a row that could have had more
                    extend(seq, row, now, update)
                if s.drafts and not update.finished:
                    # K/V is right up to its last accepted proposal; the slots after it are
                    # written again, and blocks past its tokens go back
                    seq.num_computed_tokens = s.start + len(row)
                    self.scheduler.block_manager.trim(seq, seq.num_tokens)
                elif len(row) < s.num_steps and not update.finished:
                    # the device stops a row early only at a stop id, which finishes it here
                    raise RuntimeError(f"{len(row)} of {s.num_steps} decode steps ran, "
                                       f"with no stop")
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                update.error = f"{type(e).__name__}: {e}"
            updates.append(update)
        return updates

    def _append_one(self, seq: Sequence, token: int, now: float) -> tuple[str, bool]:
        """_append for a sequence that asks for nothing token by token (no logprobs, grammar
        or stop strings): its rules without the checks those need. Returns the new text and
        whether the sequence finished."""
        p, out = seq.params, seq.output_token_ids
        out.append(token)
        if seq.num_pending:
            seq.num_pending -= 1
        else:
            seq.num_tokens += 1
        seq.metrics.token_times.append(now)
        text = ""
        if token in self.eos_token_ids and not p.ignore_eos:
            reason, stop_reason = "stop", None
        else:
            detok = seq.detok
            if detok is not None and (text := detok.add(token)):
                seq.text += text
            if p.stop_token_ids and token in p.stop_token_ids:
                reason, stop_reason = "stop", token
            elif (len(out) >= p.max_tokens
                  or len(seq.prompt_token_ids) + len(out) >= self.max_model_len):
                reason, stop_reason = "length", None
            else:
                return text, False
        seq.stop_reason = stop_reason
        seq.metrics.finished_time = now
        self.scheduler.finish(seq, reason)
        return text, True

    def _extend(self, seq: Sequence, row: Seq[int], now: float, update: SeqUpdate) -> None:
        """A row of several tokens for a sequence that asks for nothing token by token (no
        logprobs, grammar or stop strings): _append's rules with the length limit found once
        and one scan for a stop id, the row's tokens appended and detokenized together."""
        p, out = seq.params, seq.output_token_ids
        # the row index of the token that reaches max_tokens or max_model_len
        last = max(min(p.max_tokens, self.max_model_len - len(seq.prompt_token_ids))
                   - len(out) - 1, 0)
        end, reason, stop_reason, text_end = len(row), None, None, len(row)
        if last < end:
            end = text_end = last + 1
            reason = "length"
        eos = () if p.ignore_eos else self.eos_token_ids
        stop_ids = p.stop_token_ids
        for j in range(end):
            token = row[j]
            if token in eos:  # ends the text without being part of it
                end, text_end, reason, stop_reason = j + 1, j, "stop", None
                break
            if stop_ids and token in stop_ids:
                end = text_end = j + 1
                reason, stop_reason = "stop", token
                break
        tokens = list(row[:end])
        out.extend(tokens)
        taken = min(seq.num_pending, end)  # they take the place of pending tokens
        seq.num_pending -= taken
        seq.num_tokens += end - taken
        seq.metrics.token_times.extend([now] * end)
        update.new_token_ids.extend(tokens)
        detok = seq.detok
        if detok is not None and text_end:
            add = detok.add
            new_text = add(tokens[0]) if text_end == 1 else "".join(
                [add(t) for t in tokens[:text_end]])
            if new_text:
                seq.text += new_text
                update.new_text += new_text
        if reason is not None:
            seq.stop_reason = stop_reason
            seq.metrics.finished_time = now
            self.scheduler.finish(seq, reason)
            update.finished = True

    def _append(self, seq: Sequence, token: int, now: float, logprob: dict | None,
                update: SeqUpdate) -> None:
        seq.append_token(token)
        seq.metrics.token_times.append(now)
        update.new_token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        p = seq.params
        reason, stop_reason = None, None
        # The grammar (structured output) sees every token; once complete, nothing may follow.
        state, detok = seq.logits_state, seq.detok
        grammar_done = state is not None and state.consume(token)
        is_eos = token in self.eos_token_ids and not p.ignore_eos
        new_text = "" if detok is None or is_eos else detok.add(token)
        if new_text:
            seq.text += new_text
        if is_eos:
            reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif new_text and p.stop:
            # Only the tail can hold a new match: the new text plus a stop string's length.
            window = len(new_text) + max(len(s) for s in p.stop)
            start = max(0, len(seq.text) - window)
            hits = [(seq.text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                idx, stop_reason = min(hits)
                if p.include_stop_str_in_output:
                    idx += len(stop_reason)
                new_text = new_text[:max(0, len(new_text) - (len(seq.text) - idx))]
                seq.text = seq.text[:idx]
                reason = "stop"
        if reason is None and grammar_done:
            reason = "stop"
        if new_text:
            update.new_text += new_text
        if reason is None and seq.reaches_length(len(seq.output_token_ids), self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.stop_reason = stop_reason
            seq.metrics.finished_time = now
            self.scheduler.finish(seq, reason)
            update.finished = True
