"""The engine thread's mailbox into an event loop: every item once, in order, and one
wake-up for a burst posted while the loop was busy."""

from __future__ import annotations

import asyncio
import threading

from actors.serving.loop_mailbox import LoopMailbox, mailbox_of


def test_a_burst_from_another_thread_is_one_wakeup_and_keeps_order():
    async def main() -> tuple[list[list[int]], int]:
        box = mailbox_of(asyncio.get_running_loop())
        assert mailbox_of(asyncio.get_running_loop()) is box
        queues: list[asyncio.Queue[int]] = [asyncio.Queue() for _ in range(4)]
        before = box.wakeups

        def engine_step() -> None:  # 100 events over 4 requests, as one step posts them
            for i in range(100):
                box.post(queues[i % 4].put_nowait, i)

        t = threading.Thread(target=engine_step)
        t.start()
        t.join()  # the loop did not run meanwhile: everything waits for one flush
        got = [[await q.get() for _ in range(25)] for q in queues]
        return got, box.wakeups - before

    got, wakeups = asyncio.run(main())
    assert got == [list(range(r, 100, 4)) for r in range(4)]
    assert wakeups == 1


def test_posts_after_a_flush_wake_the_loop_again_and_nothing_is_lost():
    async def main() -> list[int]:
        box = LoopMailbox(asyncio.get_running_loop())
        q: asyncio.Queue[int] = asyncio.Queue()
        out = []
        for burst in range(5):
            t = threading.Thread(
                target=lambda b=burst: [box.post(q.put_nowait, b * 10 + i) for i in range(3)]
            )
            t.start()
            t.join()
            out += [await q.get() for _ in range(3)]
        assert box.wakeups == 5
        return out

    assert asyncio.run(main()) == [b * 10 + i for b in range(5) for i in range(3)]


def test_a_closed_loop_drops_posts_without_raising():
    loop = asyncio.new_event_loop()
    box = LoopMailbox(loop)
    q: asyncio.Queue[int] = asyncio.Queue()
    loop.close()
    box.post(q.put_nowait, 1)  # the consumer is gone: dropped
    box.post(q.put_nowait, 2)
    assert q.empty()
