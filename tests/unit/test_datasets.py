"""sim/datasets.py: ShareGPT and MT-bench as shipped in their packages, vLLM's filter."""

from __future__ import annotations

import importlib.util
import json

import pytest

from errors import PackageUnavailable
from sim import datasets
from sim.datasets import ChatPair


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


needs_sharegpt = pytest.mark.skipif(
    not installed(datasets.SHAREGPT_MODULE),
    reason=f"the package {datasets.SHAREGPT_PACKAGE!r} is not installed",
)
needs_mtbench = pytest.mark.skipif(
    not installed(datasets.MTBENCH_MODULE),
    reason=f"the package {datasets.MTBENCH_PACKAGE!r} is not installed",
)


def words(text: str) -> list[int]:
    return [len(w) for w in text.split()]


# -- parsing a cut-off array ------------------------------------------------------------------
def test_parse_stops_at_the_last_complete_record():
    full = json.dumps([{"id": i, "v": "x" * i} for i in range(5)], indent=2)
    assert [r["id"] for r in datasets.parse_json_records(full)] == [0, 1, 2, 3, 4]
    cut = full[: full.index('"id": 3') + 4]  # inside the fourth record
    assert [r["id"] for r in datasets.parse_json_records(cut)] == [0, 1, 2]
    assert datasets.parse_json_records("[]") == []
    with pytest.raises(ValueError):
        datasets.parse_json_records('{"a": 1}')


def test_pairs_need_a_human_turn_then_a_gpt_turn():
    def turn(who: str, text: str) -> dict:
        return {"from": who, "value": text}

    records = (
        {"id": "a", "conversations": [turn("human", "q"), turn("gpt", "r")]},
        {"id": "b", "conversations": [turn("gpt", "r"), turn("human", "q")]},
        {"id": "c", "conversations": [turn("human", "q")]},
        {"id": "d", "conversations": []},
    )
    assert datasets.sharegpt_pairs(records) == [ChatPair("a", "q", "r")]


# -- vLLM's filter and the cap ------------------------------------------------------------------
def test_filter_bounds_match_vllm():
    assert datasets.is_valid_sequence(4, 4)
    assert not datasets.is_valid_sequence(3, 100)
    assert not datasets.is_valid_sequence(100, 3)
    assert datasets.is_valid_sequence(1024, 1024)
    assert not datasets.is_valid_sequence(1025, 10)
    assert not datasets.is_valid_sequence(1000, 1049)


def test_sample_filters_on_the_reply_then_caps_it():
    def pair(name: str, p: int, r: int) -> ChatPair:
        return ChatPair(name, " ".join(["w"] * p), " ".join(["w"] * r))

    pairs = [
        pair("ok", 10, 500),
        pair("short-prompt", 3, 50),
        pair("short-reply", 50, 3),
        pair("long-prompt", 1025, 10),
        pair("too-long", 1000, 1100),
        pair("edge", 1024, 1024),
    ]
    got = datasets.sample_sharegpt(10, words, seed=1, max_output=128, pairs=pairs)
    assert sorted(r.conversation_id for r in got) == ["edge", "ok"]
    ok = next(r for r in got if r.conversation_id == "ok")
    assert (ok.prompt_len, ok.reply_len, ok.output_len) == (10, 500, 128)
    uncapped = datasets.sample_sharegpt(10, words, seed=1, pairs=pairs)
    assert {r.output_len for r in uncapped} == {500, 1024}
    assert len(datasets.sample_sharegpt(1, words, seed=1, pairs=pairs)) == 1
    with pytest.raises(ValueError):
        datasets.sample_sharegpt(1, words, max_output=0, pairs=pairs)


# -- the shipped data ---------------------------------------------------------------------------
@needs_sharegpt
def test_sharegpt_counts_of_the_cut_off_file():
    records = datasets.load_sharegpt()
    assert 17_000 <= len(records) <= 18_000
    pairs = datasets.sharegpt_pairs()
    assert 10_800 <= len(pairs) <= 11_400
    assert all(p.prompt and p.reply for p in pairs[:100])


@needs_sharegpt
def test_sharegpt_sample_is_deterministic_and_filtered():
    a = datasets.sample_sharegpt(64, words, seed=7, max_output=128)
    b = datasets.sample_sharegpt(64, words, seed=7, max_output=128)
    c = datasets.sample_sharegpt(64, words, seed=8, max_output=128)
    assert a == b
    assert a != c
    assert len(a) == 64
    assert len({r.conversation_id for r in a}) == 64
    for r in a:
        assert datasets.is_valid_sequence(r.prompt_len, r.reply_len)
        assert r.output_len == min(r.reply_len, 128)
        assert r.prompt_len == len(words(r.prompt))


@needs_mtbench
def test_mtbench_shape():
    qs = datasets.load_mtbench()
    assert len(qs) == 80
    assert len({q.question_id for q in qs}) == 80
    assert all(len(q.turns) == 2 and all(t.strip() for t in q.turns) for q in qs)
    assert {"writing", "math", "coding"} <= {q.category for q in qs}
    with_refs = [q for q in qs if q.reference]
    assert len(with_refs) == 30
    assert all(len(q.reference or ()) == 2 for q in with_refs)
    text = datasets.mtbench_reference_text()
    assert text == datasets.mtbench_reference_text()
    assert with_refs[0].reference and text.startswith(with_refs[0].reference[0])
    assert len(text.split()) > 5_000


# -- a missing package --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loader", "package"),
    [
        (datasets.load_sharegpt, datasets.SHAREGPT_PACKAGE),
        (datasets.load_mtbench, datasets.MTBENCH_PACKAGE),
    ],
)
def test_missing_package_names_it(monkeypatch, loader, package):
    real = importlib.util.find_spec
    hidden = {datasets.SHAREGPT_MODULE, datasets.MTBENCH_MODULE}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a)
    )
    loader.cache_clear()
    try:
        with pytest.raises(PackageUnavailable, match=package):
            loader()
    finally:
        loader.cache_clear()
