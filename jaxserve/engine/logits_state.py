"""The host side of one request's logit processing (runtime/logits_processing.py holds the
device side): what its row of the step's token mask and history arrays holds, built from the
tokens the host has. No jax here."""

from __future__ import annotations

import threading

import numpy as np

from jaxserve.core.sampling_params import SamplingParams

_executor = None  # llguidance's thread pool for the grammar masks, made at the first use
_executor_lock = threading.Lock()


def token_bits(token_ids, vocab_size: int) -> np.ndarray:
    """(ceil(V / 32),) int32 mask with exactly `token_ids` allowed."""
    bits = np.zeros(-(-vocab_size // 32) * 32, bool)
    bits[np.asarray(token_ids, np.int64)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)


def clear_bits(row: np.ndarray, token_ids) -> None:
    """Disallow `token_ids` in the int32 mask row `row`, in place."""
    words = row.view(np.uint32)
    for t in token_ids:
        words[t // 32] &= ~np.uint32(1 << (t % 32))


class LogitsState:
    """Built once per request (LLMEngine.add_request) when its params process the logits."""

    __slots__ = ("allowed", "bad_words", "stop_ids", "prompt_ids", "matcher")

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], vocab_size: int,
                 eos_token_ids, bad_words: list[list[int]], matcher=None):
        self.allowed = (token_bits(params.allowed_token_ids, vocab_size)
                        if params.allowed_token_ids is not None else None)
        self.bad_words = bad_words  # token ids of each bad word (and its spaced variant)
        # min_tokens bans what would stop the request early
        self.stop_ids = sorted(set(params.stop_token_ids)
                               | (set() if params.ignore_eos else set(eos_token_ids)))
        self.prompt_ids = (np.unique(np.asarray(prompt_token_ids, np.int64))
                           if params.penalized else None)
        self.matcher = matcher  # an llguidance matcher (engine/structured_output.py), or None

    def history(self, seq) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The distinct tokens of the prompt and the output, with their counts in the output
        and whether the prompt holds them."""
        out_ids, counts = np.unique(np.asarray(seq.output_token_ids, np.int64),
                                    return_counts=True)
        ids = np.union1d(self.prompt_ids, out_ids)
        out_counts = np.zeros(len(ids), np.int32)
        out_counts[np.searchsorted(ids, out_ids)] = counts
        return ids, out_counts, np.isin(ids, self.prompt_ids, assume_unique=True)

    @staticmethod
    def fill_grammar_masks(rows, mask: np.ndarray) -> None:
        """Write the grammar masks of `rows` ((row index, Sequence) whose state has a
        matcher) into their rows of the step's `mask`, all at once on llguidance's threads
        (which do not hold the GIL)."""
        global _executor
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask_par

        with _executor_lock:
            if _executor is None:
                _executor = llguidance.LLExecutor()
        fill_next_token_bitmask_par(_executor, [(seq.logits_state.matcher, i)
                                                for i, seq in rows], mask)

    def fill_mask(self, seq, row: np.ndarray) -> None:
        """Narrow row `row` of the step's mask (its grammar's mask, or all allowed) to what
        the request's other options allow for its next token."""
        if self.allowed is not None:
            row &= self.allowed
        out = seq.output_token_ids
        banned = list(self.stop_ids) if len(out) < seq.params.min_tokens else []
        for word in self.bad_words:
            *head, last = word
            if not head or (len(out) >= len(head) and out[len(out) - len(head):] == head):
                banned.append(last)
        clear_bits(row, banned)

    def consume(self, token: int) -> bool:
        """The host has the request's next token: advance the grammar. True when the grammar
        is complete (nothing may follow), which ends the request."""
        if self.matcher is None:
            return False
        self.matcher.consume_token(token)
        return self.matcher.is_stopped()
