"""The byte-level table path of incremental detokenization against the window path and the
tokenizer's own decode: the default model's real tokenizer, and small tokenizers built here."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.detokenizer import ByteLevelTable, IncrementalDetokenizer, TokenDecoder
from jaxserve.models.gguf_tokenizer import byte_alphabet

slow = pytest.mark.slow  # the default model's tokenizer
MULTIBYTE = "你好，世界! 🙂👍🏽 naïve café — ∑x² ẞ"


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm.tokenizer


@pytest.fixture(scope="module")
def decoders(tok):
    """(table path, window path) over the same tokenizer."""
    window = TokenDecoder(tok)
    window.table = None
    return TokenDecoder(tok), window


@pytest.fixture(scope="module")
def byte_ids(tok):
    """byte -> the id of the token that is that one byte (this vocabulary lacks a few: 0xC0,
    0xC1 and 0xF5-0xFF, never in UTF-8, and some controls and rare lead bytes)."""
    vocab = tok.get_vocab()
    return {b: vocab[c] for b, c in byte_alphabet().items() if c in vocab}


def _spell(byte_ids, data: bytes) -> list[int]:
    return [byte_ids[b] for b in data]


def _run(decoder, prompt, tokens, skip) -> list[str]:
    detok = IncrementalDetokenizer(decoder, prompt, skip)
    return [detok.add(t) for t in tokens]


@slow
def test_default_tokenizer_gets_the_table(tok, decoders):
    table = decoders[0].table
    assert table is not None and table.size == len(tok)
    # each token's own text, where whole, is the tokenizer's
    ids = list(range(0, table.size, 7))
    for skip in (False, True):
        singles = tok.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=skip)
        texts = table.texts[skip]
        assert [texts[i] for i in ids] == [s if s and s[-1] != "\ufffd" else None
                                           for s in singles]
    assert table.texts[True][tok.eos_token_id] is None
    assert table.texts[False][tok.eos_token_id] == tok.eos_token


@slow
@pytest.mark.parametrize("skip", [True, False])
def test_table_path_equals_window_path_on_random_ids(tok, decoders, byte_ids, skip):
    rng = np.random.default_rng(1 if skip else 2)
    multibyte = tok(MULTIBYTE, add_special_tokens=False).input_ids
    spelled = _spell(byte_ids, MULTIBYTE.encode())
    pools = [list(range(len(tok))),  # anything, past the vocabulary too
             multibyte + list(tok.all_special_ids),
             list(byte_ids.values()) + spelled,  # invalid sequences, split characters
             spelled + list(tok.all_special_ids)]
    for i in range(400):
        prompt = rng.integers(0, len(tok), int(rng.integers(0, 8))).tolist()
        if i % 3 == 0:  # a prompt ending inside a character
            prompt += _spell(byte_ids, "好🙂".encode()[:int(rng.integers(1, 6))])
        pool = pools[i % len(pools)]
        tokens = [int(t) for t in rng.choice(pool, 40)]
        if i % len(pools) == 0:
            tokens[int(rng.integers(0, 40))] = len(tok) + 5  # an id the tokenizer lacks
        fast, window = (_run(d, prompt, tokens, skip) for d in decoders)
        assert fast == window, (prompt, tokens)


@slow
@pytest.mark.parametrize("skip", [True, False])
def test_split_characters_come_out_whole(tok, decoders, byte_ids, skip):
    """Characters spelled a byte per token: nothing until each is complete, then all of it."""
    data = MULTIBYTE.encode()
    tokens = _spell(byte_ids, data)
    prompt = tok("Say:").input_ids
    for decoder in decoders:
        pieces = _run(decoder, prompt, tokens, skip)
        assert "".join(pieces) == MULTIBYTE == tok.decode(tokens, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)
        # a piece comes out exactly where the bytes so far end on a whole character
        ends = [len(data[:k + 1].decode("utf-8", "ignore").encode()) == k + 1
                for k in range(len(data))]
        assert [bool(p) for p in pieces] == ends


@slow
@pytest.mark.parametrize("skip", [True, False])
def test_invalid_bytes_render_as_the_tokenizer_does(tok, decoders, byte_ids, skip):
    data = b"a\xe4\xbd b\xe4\xbd\xa0\xa0c\xed\xa0\x80d\xf0\x9f\x99e\xe0\x80\x80f\x80\xbfg!"
    tokens = _spell(byte_ids, data)
    expected = tok.decode(tokens, skip_special_tokens=skip)
    assert expected == data.decode("utf-8", "replace")
    for decoder in decoders:
        assert "".join(_run(decoder, [], tokens, skip)) == expected


@slow
def test_special_tokens_skipped_or_kept(tok, decoders, byte_ids):
    """A skipped special token between a character's bytes leaves the character whole, as the
    tokenizer joins the other tokens' bytes."""
    end = tok.convert_tokens_to_ids("<|im_end|>")
    tokens = (tok("Hi there", add_special_tokens=False).input_ids + [end]
              + _spell(byte_ids, "你".encode()[:1]) + [end]
              + _spell(byte_ids, "你".encode()[1:]) + [end] + tok("!").input_ids)
    for skip, want in ((True, "Hi there你!"),
                       (False, "Hi there<|im_end|>\ufffd<|im_end|>\ufffd\ufffd<|im_end|>!")):
        assert tok.decode(tokens, skip_special_tokens=skip) == want
        for decoder in decoders:
            assert "".join(_run(decoder, tok("Q").input_ids, tokens, skip)) == want


@slow
def test_real_text_and_its_context(tok, decoders):
    """Text encoded by the tokenizer, after a prompt: the pieces are the text, whole."""
    text = ("The capital of France is Paris.\n\n```python\nprint('héllo')\n```\n"
            + MULTIBYTE + " 1234 tabs\there")
    ids = tok(text, add_special_tokens=False).input_ids
    for prompt in ([], tok("<|im_start|>assistant\n").input_ids, ids[:3]):
        pieces = _run(decoders[0], prompt, ids, True)
        assert pieces == _run(decoders[1], prompt, ids, True)
        assert "".join(pieces) == text


def _byte_level_tokenizer(**kw):
    """A small byte-level BPE tokenizer (the 256 byte tokens, two merges) with added tokens
    whose characters are all in the byte-level map ("éé": bytes E9 E9) or not ("<é x>")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(byte_alphabet().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["ab"], vocab["abc"] = 256, 257
    backend = Tokenizer(models.BPE(vocab, [("a", "b"), ("ab", "c")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken("éé", special=False), AddedToken("<é x>", special=False)])
    backend.add_special_tokens([AddedToken("<|end|>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kw)


def test_small_byte_level_tokenizer_with_odd_added_tokens():
    tok = _byte_level_tokenizer(clean_up_tokenization_spaces=False)
    decoder = TokenDecoder(tok)
    assert decoder.table is not None
    window = TokenDecoder(tok)
    window.table = None
    rng = np.random.default_rng(3)
    n = len(tok)
    for i in range(300):
        tokens = [int(t) for t in rng.integers(0, n + 2, 30)]
        prompt = [int(t) for t in rng.integers(0, n, i % 6)]
        for skip in (True, False):
            assert (decoder.table.decode(tokens, skip)
                    == tok.decode(tokens, skip_special_tokens=skip))
            pieces = _run(decoder, prompt, tokens, skip)
            assert pieces == _run(window, prompt, tokens, skip)


def test_other_tokenizers_decode_windows():
    """No table where the tokenizer's decode is more than the byte-level decoder's: spaces
    cleaned up, or another decoder; their text is still right, by windows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert TokenDecoder(_byte_level_tokenizer(clean_up_tokenization_spaces=True)).table is None
    words = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", ".", "▁é"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="."))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    decoder = TokenDecoder(tok)
    assert decoder.table is None
    ids = [0, 1, 2, 3, 0, 4, 5, 6]
    assert "".join(_run(decoder, [], ids, True)) == tok.decode(ids) == "the cat sat on the mat. é"


@slow
def test_byte_level_table_refuses_negative_ids(decoders):
    detok = IncrementalDetokenizer(decoders[0], [], True)
    with pytest.raises(OverflowError):
        detok.add(-1)
    assert ByteLevelTable.of(decoders[0].tokenizer) is decoders[0].table  # built once
