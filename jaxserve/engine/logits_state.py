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


def _grammar_executor():
    """llguidance's thread pool, made at the first use."""
    global _executor
    import llguidance

    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
    return _executor


class LogitsState:
    """Built once per request (LLMEngine.add_request) when its params process the logits.

    The samples of an n > 1 request share the parts that only depend on the request
    (`shared()`: its allowed mask and bad words); each keeps its own grammar and history."""

    __slots__ = ("allowed", "bad_words", "stop_ids", "matcher", "hist_ids", "hist_counts",
                 "hist_in_prompt", "hist_size", "_hist_row")

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], vocab_size: int,
                 eos_token_ids, bad_words: list[list[int]], matcher=None):
        self.allowed = (token_bits(params.allowed_token_ids, vocab_size)
                        if params.allowed_token_ids is not None else None)
        self.bad_words = bad_words  # token ids of each bad word (and its spaced variant)
        # min_tokens bans what would stop the request early
        self.stop_ids = params.stop_ids(eos_token_ids)
        self.matcher = matcher  # an llguidance matcher (engine/structured_output.py), or None
        # The penalties' history: the distinct tokens of the prompt and the output so far,
        # each with its count in the output and whether the prompt holds it. It grows by one
        # token per step (consume), so a step copies it rather than recounting the output.
        self.hist_size = 0
        self._hist_row: dict[int, int] | None = None  # token id -> its slot
        if params.penalized:
            ids = np.unique(np.asarray(prompt_token_ids, np.int64)).astype(np.int32)
            self.hist_size = len(ids)
            cap = len(ids) + min(params.max_tokens or 64, 64)
            self.hist_ids = np.zeros(cap, np.int32)
            self.hist_ids[:len(ids)] = ids
            self.hist_counts = np.zeros(cap, np.int32)
            self.hist_in_prompt = np.zeros(cap, bool)
            self.hist_in_prompt[:len(ids)] = True
            self._hist_row = {t: i for i, t in enumerate(ids.tolist())}

    def sibling(self, matcher=None) -> LogitsState:
        """The state of another sample of the same request: the request's parts shared, its
        own grammar matcher and history."""
        twin = object.__new__(LogitsState)
        twin.allowed, twin.bad_words, twin.stop_ids = self.allowed, self.bad_words, self.stop_ids
        twin.matcher = matcher
        twin.hist_size, twin._hist_row = self.hist_size, None
        if self._hist_row is not None:
            twin._hist_row = dict(self._hist_row)
            twin.hist_ids = self.hist_ids.copy()
            twin.hist_counts = self.hist_counts.copy()
            twin.hist_in_prompt = self.hist_in_prompt.copy()
        return twin

    def history(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, output counts, in prompt) of the history's distinct tokens."""
        n = self.hist_size
        return self.hist_ids[:n], self.hist_counts[:n], self.hist_in_prompt[:n]

    def _count(self, token: int) -> None:
        i = self._hist_row.get(token)
        if i is None:
            i = self._hist_row[token] = self.hist_size
            if i == len(self.hist_ids):  # full: double it
                grow = lambda a: np.concatenate([a, np.zeros_like(a)])
                self.hist_ids, self.hist_counts, self.hist_in_prompt = map(
                    grow, (self.hist_ids, self.hist_counts, self.hist_in_prompt))
            self.hist_ids[i] = token
            self.hist_size += 1
        self.hist_counts[i] += 1

    @staticmethod
    def fill_grammar_masks(rows, mask: np.ndarray) -> None:
        """Write the grammar masks of `rows` ((row index, Sequence) whose state has a
        matcher) into their rows of the step's `mask`, all at once on llguidance's threads
        (which do not hold the GIL)."""
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(_grammar_executor(), [(seq.logits_state.matcher, i)
                                                          for i, seq in rows], mask)

    @staticmethod
    def fill_proposal_masks(rows, mask: np.ndarray) -> None:
        """Speculative decoding: for each (row index, Sequence, proposed tokens) of `rows`,
        whose grammar is its only processing, write into mask[row, j] its grammar's mask
        after the first j + 1 proposals (the proposal's position j + 1). llguidance makes the
        masks of every position at once, from the current one, on its threads."""
        from llguidance.numpy import fill_next_token_bitmask_par_with_draft_tokens

        k1 = mask.shape[1] + 1
        scratch = np.zeros((len(rows) * k1, mask.shape[2]), np.int32)
        fill_next_token_bitmask_par_with_draft_tokens(
            _grammar_executor(),
            [(seq.logits_state.matcher, n * k1, list(drafts))
             for n, (_, seq, drafts) in enumerate(rows)], scratch)
        for n, (i, _, drafts) in enumerate(rows):
            mask[i, :len(drafts)] = scratch[n * k1 + 1:n * k1 + 1 + len(drafts)]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from its current state."""
        return len(tokens) if self.matcher is None else self.matcher.validate_tokens(tokens)

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
        """The host has the request's next token: count it, advance the grammar. True when
        the grammar is complete (nothing may follow), which ends the request."""
        if self._hist_row is not None:
            self._count(token)
        if self.matcher is None:
            return False
        self.matcher.consume_token(token)
        return self.matcher.is_stopped()
