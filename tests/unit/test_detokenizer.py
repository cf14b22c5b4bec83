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
