"""Completions' and chat's shared answer parts: usage, the choices that moved, and logprobs in
each API's shape (`tok`: the model's tokenizer, None if it has none)."""

from __future__ import annotations

import itertools


def usage(out) -> dict:
    p, c = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def usage_chunk(base: dict):
    """stream_options.include_usage: a last chunk with no choices carries the usage, as
    OpenAI's API does."""
    return lambda last: base | {"choices": [], "usage": usage(last)}


def moved(out) -> list:
    """The samples with something new in this output (all but the n > 1 ones that waited)."""
    return [c for c in out.outputs if c.updated]


def token_text(tok, token_id: int) -> str:
    return tok.decode([token_id]) if tok is not None else str(token_id)


def _entries(comp, new_only: bool) -> list[tuple[int, dict]] | None:
    """(token id, {"logprob", "top"}) for the completion's tokens (or this step's only)."""
    if comp.logprobs is None:
        return None
    # The engine keeps appending to the entries: the output's own token ids say how many
    # are its own.
    ids = comp.token_ids
    entries = comp.logprobs[:len(ids)]
    if new_only:
        n = len(comp.new_token_ids)
        ids, entries = ids[len(ids) - n:], entries[len(entries) - n:]
        if not n:
            return None
    return list(zip(ids, entries, strict=True))


def completion_logprobs(tok, comp, new_only: bool = False, shift: int = 0) -> dict | None:
    """OpenAI completions' shape: tokens, token_logprobs, top_logprobs, text_offset (from
    the completion's start, plus `shift`)."""
    pairs = _entries(comp, new_only)
    if pairs is None:
        return None
    start = len(comp.text) - len(comp.new_text) if new_only else 0
    return completion_logprobs_of(tok, pairs, shift + start)


def completion_logprobs_of(tok, pairs: list[tuple[int, dict]], start: int,
                           first: int | None = None) -> dict:
    """(token id, entry) pairs in completions' shape; `first`: a token before them with
    no logprob (an echoed prompt's first), given as null like OpenAI does."""
    tokens = [token_text(tok, t) for t, _ in pairs]
    lps = [e["logprob"] for _, e in pairs]
    tops = [{token_text(tok, k): v for k, v in e["top"].items()} for _, e in pairs]
    if first is not None:
        tokens, lps, tops = [token_text(tok, first), *tokens], [None, *lps], [None, *tops]
    offsets = list(itertools.accumulate(map(len, tokens[:-1]), initial=start))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def prompt_logprobs(tok, out) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (the first: null), {token id: {logprob,
    rank, decoded_token}} for the token itself and the top ones."""
    result = []
    for token, e in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
        if e is None:
            result.append(None)
            continue
        entry = {str(token): {"logprob": e["logprob"], "rank": e["rank"],
                              "decoded_token": token_text(tok, token)}}
        for rank, (t, lp) in enumerate(e["top"].items(), 1):
            entry.setdefault(str(t), {"logprob": lp, "rank": rank,
                                      "decoded_token": token_text(tok, t)})
        result.append(entry)
    return result


def chat_logprobs(tok, comp, new_only: bool = False) -> dict | None:
    """OpenAI chat's shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    pairs = _entries(comp, new_only)
    if pairs is None:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(tok, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [item(t, e["logprob"]) | {"top_logprobs": [
        item(k, v) for k, v in e["top"].items()]} for t, e in pairs]}
