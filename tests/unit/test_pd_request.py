"""A disaggregated request re-run after its replica died streams each token to the caller
once: the replayed tokens of the new attempt are dropped, the new ones pass."""

from __future__ import annotations

from actors.disagg.pd_request import PDRequest
from actors.engine.outputs import RequestOutput, StreamDelta
from policies.request import Request, SamplingParams


def request() -> PDRequest:
    return PDRequest(Request("r", [1, 2, 3], SamplingParams(max_tokens=5), 7, 4, []))


def delta(tokens: list[int], finished: bool = False) -> StreamDelta:
    return StreamDelta("r#x", tokens, "t" * len(tokens), finished, "length" if finished else None)


def test_replayed_tokens_are_dropped_and_new_ones_pass():
    r = request()
    r.start_attempt("r#1", "p0", "d0")
    assert r.stream(delta([10]), 1.0).token_ids == [10]
    assert r.stream(delta([11]), 2.0).token_ids == [11]
    r.drop_attempt()  # its decode replica died: run it again from the prompt
    r.start_attempt("r#2", "p0", "d0")
    assert r.attempts == 2 and r.in_prefill
    assert r.stream(delta([10]), 3.0) is None  # replay
    out = r.stream(delta([11, 12]), 4.0)  # one replayed, one new
    assert out is not None and out.token_ids == [12] and out.request_id == "r"
    last = r.stream(delta([13], finished=True), 5.0)
    assert last is not None and last.finished and last.token_ids == [13]
    assert [t for d in r.deltas for t in d.token_ids] == [10, 11, 12, 13]
    assert r.token_times == [1.0, 2.0, 4.0, 5.0]
    r.finish(RequestOutput("r#2", [1, 2, 3], [10, 11, 12, 13], "", True, "length"))
    assert r.output is not None and r.output.request_id == "r" and r.key is None


def test_ending_keeps_what_was_streamed():
    r = request()
    r.start_attempt("r#1", "p0", "d0")
    r.stream(delta([10, 11]), 1.0)
    r.end()
    assert r.output is not None
    assert r.output.token_ids == [10, 11] and r.output.finish_reason == "abort"
    assert r.output.text == "tt"


def test_a_request_that_finished_before_its_prefill_reported_is_no_longer_in_prefill():
    """Decode's ``Finished`` may reach the Conductor before the prefill replica's
    ``PrefillDone``: the ended request no longer counts as in prefill there (a draining
    prefill replica waits for none of it)."""
    r = request()
    r.start_attempt("r#1", "p0", "d0")
    assert r.in_prefill
    r.finish(RequestOutput("r#1", [1, 2, 3], [10], "", True, "length"))
    assert not r.in_prefill and r.prefill_id == "p0"
