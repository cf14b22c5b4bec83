import pytest

from policies.availability import OutstandingCap, PendingAvailability, RemoteAvailability


def test_unknown_until_probed_then_free():
    a = PendingAvailability()
    a.add("r0")
    assert not a.available("r0", 0.0)  # never probed
    a.on_probe("r0", pending=0, sent_at=0.0, now=0.01)
    assert a.available("r0", 0.01)
    a.on_probe("r0", pending=2, sent_at=0.1, now=0.11)
    assert not a.available("r0", 0.11)


def test_optimistic_push_blocks_a_second_push_between_probes():
    a = PendingAvailability()
    a.add("r0")
    a.add("r1")
    a.on_probe("r0", 0, 0.0, 0.0)
    a.on_probe("r1", 0, 0.0, 0.0)
    a.on_push("r0", "q1", 0.02)
    assert a.available_set(0.03) == {"r1"}
    # the balancer saw q1's first token: r0 is free again before the next probe
    a.on_prefilled("r0", "q1", 0.05)
    assert a.available("r0", 0.05)
    a.on_push("r0", "q2", 0.06)
    # a probe sent before q2's push cannot have seen it: q2 still counts
    a.on_probe("r0", 0, sent_at=0.05, now=0.07)
    assert not a.available("r0", 0.07)
    # a probe sent after it has: its count replaces the optimistic one
    a.on_probe("r0", 0, sent_at=0.1, now=0.11)
    assert a.available("r0", 0.11)


def test_lost_pushes_expire_and_max_pending():
    a = PendingAvailability(max_pending=2, push_ttl=1.0)
    a.add("r")
    a.on_probe("r", 0, 0.0, 0.0)
    a.on_push("r", "q1", 0.1)
    assert a.available("r", 0.2)  # one pending < 2
    a.on_push("r", "q2", 0.2)
    assert not a.available("r", 0.3)
    assert a.available("r", 1.25)  # q1 and q2 unconfirmed for over 1 s
    with pytest.raises(ValueError):
        PendingAvailability(max_pending=0)


def test_outstanding_cap_counts_until_finish():
    c = OutstandingCap(cap=2)
    c.add("r")
    c.on_push("r", "a", 0.0)
    c.on_push("r", "b", 0.0)
    c.on_prefilled("r", "a", 0.1)
    assert not c.available("r", 0.1)
    c.on_finished("r", "a", 0.2)
    assert c.available("r", 0.2)


def test_remote_free_replicas_and_queue():
    r = RemoteAvailability(max_queue=1)
    r.add("eu")
    assert not r.available("eu", 0.0)
    r.on_probe("eu", free_replicas=2, queue_len=0, sent_at=0.0, now=0.05)
    assert r.available("eu", 0.05)
    r.on_forward("eu", "q1", 0.06)
    assert r.free_replicas("eu", 0.06) == 1
    r.on_forward("eu", "q2", 0.07)
    assert not r.available("eu", 0.07)  # both free replicas used up optimistically
    r.on_probe("eu", free_replicas=3, queue_len=2, sent_at=0.1, now=0.15)
    assert not r.available("eu", 0.15)  # queue longer than tau
    r.on_probe("eu", free_replicas=0, queue_len=0, sent_at=0.2, now=0.25)
    assert not r.available("eu", 0.25)
