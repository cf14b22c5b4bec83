from __future__ import annotations

from actors.engine.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token i decodes to chr(i); 0xFFFD stands in for a half-decoded character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def feed(detok, text, final_at_end=True):
    out = []
    for i, ch in enumerate(text):
        out.append(detok.add([ord(ch)], final=final_at_end and i == len(text) - 1))
        if detok.stopped:
            break
    return "".join(out)


def test_plain_text_is_released_in_full():
    d = IncrementalDetokenizer(CharTokenizer(), [])
    assert feed(d, "hello") == "hello" == d.text


def test_stop_string_cuts_text_and_stops():
    d = IncrementalDetokenizer(CharTokenizer(), ["END"])
    assert feed(d, "abcENDxyz") == "abc"
    assert d.stopped and d.text == "abc"


def test_partial_stop_prefix_held_back_then_released():
    d = IncrementalDetokenizer(CharTokenizer(), ["END"])
    assert d.add([ord("a")]) == "a"
    assert d.add([ord("E")]) == "", "could be the start of END"
    assert d.add([ord("x")]) == "Ex"
    assert not d.stopped


def test_replacement_char_held_until_final():
    d = IncrementalDetokenizer(CharTokenizer(), [])
    assert d.add([ord("a"), 0xFFFD]) == "a"
    assert d.add([], final=True) == "\ufffd"


class CountingTokenizer:
    """A real tokenizer that counts the token ids it decodes."""

    def __init__(self, tok):
        self.tok = tok
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def llama_style():
    """Metaspace pieces, byte fallback and a decoder that strips a decode's first space. Its
    byte tokens come in whole characters (``UNITS``): byte fallback decodes a run of byte
    tokens as one group, so an invalid run turns characters before it into U+FFFD too,
    which no streaming decode can foresee (nor a model's text contain)."""
    from tokenizers import Tokenizer, decoders, models

    pieces = ["<unk>", "\u2581Hello", "\u2581world", "!", "lo", "\u2581", "<0xE2>", "<0x82>"]
    pieces += ["<0xAC>", "\u2581caf", "\u00e9", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok, [[i] for i in range(6)] + [[6, 7, 8]] + [[9, 10]] + [[11, 12, 13, 14]]


def word_pieces():
    from tokenizers import Tokenizer, decoders, models

    pieces = ["[UNK]", "play", "##ing", "##ed", "run", "the", "##s", ",", "."]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    return tok, [[i] for i in range(len(pieces))]


def byte_level():
    from tokenizers import Tokenizer

    from models import tiny_model_dir

    tok = Tokenizer.from_file(str(tiny_model_dir("dense") / "tokenizer.json"))
    return tok, [[i] for i in range(tok.get_vocab_size())]  # any bytes, valid UTF-8 or not


def test_streamed_text_equals_the_whole_decode_with_real_tokenizers():
    import random

    rng = random.Random(0)
    for make in (byte_level, llama_style, word_pieces):
        tok, units = make()
        for trial in range(40):
            ids = [i for _ in range(rng.randrange(1, 40)) for i in rng.choice(units)]
            want = tok.decode(ids, skip_special_tokens=True)
            d = IncrementalDetokenizer(CountingTokenizer(tok), [])
            out, i = [], 0
            while i < len(ids):
                n = rng.choice((1, 1, 1, 2, 3))
                chunk, i = ids[i : i + n], i + n
                out.append(d.add(chunk, final=i >= len(ids)))
                assert want.startswith(d.text), (make.__name__, trial, d.text, want)
            assert "".join(out) == d.text == want, (make.__name__, trial)


def test_a_long_output_is_not_decoded_again_every_step():
    tok = byte_level()[0]
    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 40).ids
    counting = CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting, ["never appears"])
    for t in ids:
        d.add([t])
    d.add([], final=True)
    assert d.text == tok.decode(ids, skip_special_tokens=True)
    # a window of a few tokens a step, not the whole output (len(ids)^2 / 2 ids)
    assert counting.decoded < 8 * len(ids), (counting.decoded, len(ids))
