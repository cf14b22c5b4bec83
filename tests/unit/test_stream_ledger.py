"""The one stream ledger (the ingress replaying a prompt on another replica, a P/D request
re-placed by its Conductor): every token once, in order; a replay that differs from what
was streamed is caught."""

from __future__ import annotations

import pytest

from actors.engine.events import Delta, Done, Failed
from actors.engine.outputs import RequestOutput, StreamDelta
from actors.engine.stream_ledger import ReplayDiverged, StreamLedger


def delta(i: int, *tokens: int) -> Delta:
    return Delta(i, StreamDelta(f"r{i}", list(tokens), "".join(map(str, tokens)), False))


def done(i: int, tokens: list[int]) -> Done:
    return Done(i, RequestOutput(f"r{i}", [1], tokens, "", True, "length", 0, 0.0, 0.0, 0.0))


def passed(ledger: StreamLedger, items: list) -> list:
    return [x for x in (ledger.admit(item) for item in items) if x is not None]


def test_a_replay_continues_each_choice_where_its_consumer_stopped():
    ledger = StreamLedger(2)
    first = [delta(0, 5), delta(1, 7), delta(0, 6)]
    assert passed(ledger, first) == first
    ledger.begin_replay()  # the replica died; the same two choices run again elsewhere
    replay = [delta(0, 5), delta(1, 7), delta(0, 6), delta(1, 8), delta(0, 9)]
    replay += [done(0, [5, 6, 9]), done(1, [7, 8])]
    assert passed(ledger, replay) == replay[3:]
    assert ledger.sent == [[5, 6, 9], [7, 8]] and ledger.open_choices() == []


def test_an_ended_choice_is_not_ended_twice():
    ledger = StreamLedger(2)
    assert passed(ledger, [delta(0, 5), done(0, [5]), delta(1, 4)]) != []
    ledger.begin_replay()
    assert passed(ledger, [delta(0, 5), done(0, [5]), delta(1, 4), delta(1, 3)]) == [delta(1, 3)]
    assert ledger.open_choices() == [1]
    assert passed(ledger, [Failed(1, "gone")]) == [Failed(1, "gone")]
    assert ledger.admit(Failed(1, "again")) is None


@pytest.mark.parametrize(
    "replay",
    [
        [delta(0, 5), delta(0, 8)],  # a different token where one was streamed
        [delta(0, 5, 6, 9)],  # one delta straddles what was streamed and what was not
        [done(0, [5, 7])],  # the final output disagrees with the stream
    ],
)
def test_a_replay_that_differs_is_refused(replay):
    ledger = StreamLedger(1)
    passed(ledger, [delta(0, 5), delta(0, 6)])
    ledger.begin_replay()
    with pytest.raises(ReplayDiverged):
        passed(ledger, replay)


def test_take_cuts_a_run_that_straddles_the_replay_and_checks_what_it_replays():
    """The token-level step both the relay and a disaggregated request use."""
    ledger = StreamLedger()
    assert ledger.take(0, [5, 6]) == 0
    ledger.begin_replay()
    assert ledger.take(0, [5]) == 1  # all replay
    assert ledger.take(0, [6, 7]) == 1  # one replayed, one new
    assert ledger.sent == [[5, 6, 7]]
    ledger.begin_replay()
    with pytest.raises(ReplayDiverged):
        ledger.take(0, [9])
    assert ledger.take(0, [9], check=False) == 1  # unchecked: counted as the replay of 5
    assert ledger.sent == [[5, 6, 7]]
