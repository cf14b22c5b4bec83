"""Per-layer loads on their background thread: a step waits for each layer of the loads
writing blocks it reads, and only those; a failed load still releases every layer."""

from __future__ import annotations

import threading

from actors.disagg.layer_loader import LayerLoad, LayerLoader


def test_a_step_waits_only_for_the_loads_of_its_blocks():
    loader = LayerLoader(record=True)
    gate = threading.Event()
    order: list[str] = []

    def slow(layer: int) -> int:
        assert gate.wait(30)
        order.append(f"slow{layer}")
        return 10

    def fast(layer: int) -> int:
        order.append(f"fast{layer}")
        return 1

    # the slow load is first on the loader's one thread; the fast one queues behind it
    slow_load = LayerLoad("a", 2, slow, lambda: None, blocks=frozenset({1}))
    loader.start(slow_load)
    loader.begin_step({7})  # a step reading neither load's blocks: nothing to wait for
    loader.before_layer(0)
    loader.before_layer(1)
    assert order == []  # it ran its layers while the slow load is still blocked
    loader.start(LayerLoad("b", 2, fast, lambda: None, blocks=frozenset({2})))
    loader.begin_step({1, 2})
    threading.Timer(0.2, gate.set).start()
    loader.before_layer(0)  # waits for layer 0 of both
    assert {"slow0", "fast0"} <= set(order)
    loader.before_layer(1)
    assert order.index("slow1") < order.index("fast0")  # one thread, in order
    done = loader.take_finished()
    assert {x.key for x in done} == {"a", "b"} and slow_load.bytes_read == 20
    loader.close()


def test_a_failed_load_releases_every_layer_and_says_why():
    loader = LayerLoader()

    def broken(layer: int) -> int:
        if layer == 1:
            raise OSError("shard gone")
        return 5

    load = LayerLoad("x", 3, broken, lambda: None, blocks=frozenset({4}))
    loader.start(load)
    loader.begin_step({4})
    for layer in range(3):
        loader.before_layer(layer)  # never hangs
    (done,) = loader.take_finished()
    assert done.error is not None and "shard gone" in done.error
    assert done.bytes_read == 5
    loader.close()
