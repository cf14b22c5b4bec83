"""The event heap: time order, ties in scheduling order, events returning events."""

from __future__ import annotations

import pytest

from sim.events import Event, EventLoop


def test_events_fire_in_time_order_and_ties_in_push_order():
    loop, seen = EventLoop(), []

    def make(tag):
        def act(now):
            seen.append((now, tag))
            if tag == "a":
                return [Event(now + 1.0, make("c")), Event(now, make("b"))]
            return None

        return act

    loop.push(Event(2.0, make("x")))
    loop.push(Event(1.0, make("a")))
    loop.push(Event(2.0, make("y")))
    loop.run()
    assert seen == [(1.0, "a"), (1.0, "b"), (2.0, "x"), (2.0, "y"), (2.0, "c")]
    assert loop.fired == 5


def test_time_never_goes_backwards():
    loop = EventLoop()
    loop.push(Event(1.0, lambda now: [Event(0.5, lambda t: None)]))
    with pytest.raises(ValueError):
        loop.run()
