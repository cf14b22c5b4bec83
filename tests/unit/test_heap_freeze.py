"""The start-up heap is frozen once per process, before the first engine, and the engines
are never frozen with it."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap


def test_the_first_build_freezes_the_heap_once_and_never_an_engine():
    # a fresh interpreter: this test process froze at its first build already
    code = textwrap.dedent(
        """
        import gc, threading
        from actors.engine import heap_freeze
        from actors.engine.replica_controller import ReplicaController
        assert gc.get_freeze_count() == 0
        first = ReplicaController.build(None, device="cpu", num_blocks=16)
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # torch and the engine's modules
        assert heap_freeze.freeze_startup_heap() is False  # once per process
        # the engine itself is not frozen: collections still walk it, so its cycles stay
        # collectable when it is dropped
        assert any(o is first for o in gc.get_objects()), "the engine was frozen"
        second = ReplicaController.build(None, device="cpu", num_blocks=16)
        assert any(o is second for o in gc.get_objects()), "the second engine was frozen"
        assert gc.get_freeze_count() <= frozen  # the second build froze nothing more
        first.shutdown()
        second.shutdown()
        for t in threading.enumerate():  # the controllers' warm-up threads, before exiting
            if t.name == "meridian-ex":
                t.join()
        print("ok", frozen)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok ")


def test_freezing_is_done_before_this_process_built_its_first_engine():
    from actors.engine.heap_freeze import freeze_startup_heap
    from actors.engine.replica_controller import ReplicaController

    ReplicaController.build(None, device="cpu", num_blocks=16).shutdown()
    assert freeze_startup_heap() is False and gc.get_freeze_count() > 0
