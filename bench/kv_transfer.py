"""KV block transfer between two worker processes on this machine, in one run:
our transfer layer against memcpy and against Ray's object store.

Process A (a store shard's role) holds KV blocks in a shared-memory segment and serves it
(``TransferEngine(serve_tcp=True)``). Process B (a worker's role) pulls N MiB of blocks
into its own pre-faulted pool the way the runtime moves KV: the pool is registered once
(``engine.register(pool)``) and each pull is one ``TransferEngine.read_ranges`` call with
one ``(remote offset, local offset, nbytes)`` range per block, so the timed figure
includes building, checking and merging every block's range, then the copy. Backends: ``shm`` (same
node: one copy out of A's segment) and, for reference, ``tcp`` (what a cross-node pull
does, here over loopback). The same process B also times a plain memcpy (``np.copyto``)
of the same size between two of its own arrays: the physical limit. After one pull per
backend the pool is compared byte for byte with A's segment (the ``bytes`` column). The
Ray column moves the same bytes actor to actor through the object store (producer
returns the array, consumer copies it into its pool), timed end to end from the driver.

Blocks are 256 KiB (8 layers x K,V x 16 tokens x 8 KV heads x 64 dims x fp16). Each figure
is the best of several repeats, memcpy and shm taking turns so both see the same load
(the machine is shared; best-of is the capability; run it a few times for the spread),
each started with cold caches (a 64 MiB scratch write first, untimed): a block in transit
was written by another process, so neither path gets to copy out of this core's cache.
Target: shm >= 0.80 x memcpy at >= 16 MiB.

    python bench/kv_transfer.py [--sizes 1 16 64 256] [--no-ray]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

from bench.interleave import interleaved
from bench.local_serve import local_ray
from store.shared_segment import SharedSegment
from store.transfer import TransferEngine

MiB = 1 << 20
BLOCK = 256 * 1024


def repeats(size_mib: int) -> int:
    return max(10, min(40, 1024 // size_mib))


SCRATCH = np.ones(0, dtype=np.uint8)


def timed(fn) -> float:
    """Seconds ``fn`` takes with cold caches: a block being moved was written by another
    process, not by this core, so the last-level cache is flushed first (untimed)."""
    SCRATCH[:] += 1
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best(fn, n: int) -> float:
    return min(timed(fn) for _ in range(n))


def best_interleaved(fns: list, n: int) -> list[float]:
    """Best-of-n of each function, run in turns so all see the same machine load."""
    times = interleaved(range(len(fns)), n, lambda i, _: timed(fns[i]), rotate=False)
    return [min(t) for t in times.values()]


def holder(conn, total: int) -> None:
    """Process A: KV blocks in a shared segment, served to same-node and TCP readers."""
    seg = SharedSegment.create(total)
    seg.array[:] = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    engine = TransferEngine("holder", "bench-node", seg, serve_tcp=True)
    conn.send(engine.endpoint)
    conn.recv()  # wait until the puller is done
    engine.close()
    seg.close()


def puller(conn, endpoint, sizes: list[int]) -> None:
    """Process B: pull blocks through the transfer layer; time memcpy of the same size."""
    global SCRATCH
    SCRATCH = np.ones(64 * MiB, dtype=np.uint8)  # twice the last-level cache
    total = max(sizes) * MiB
    pool = np.zeros(total, dtype=np.uint8)  # the receiver's KV pool, pre-faulted
    pool[:] = 1
    source = np.ones(total, dtype=np.uint8)  # a local source for memcpy
    shm = TransferEngine("puller", "bench-node")
    tcp = TransferEngine("puller-tcp", "bench-node", prefer=["tcp"])
    local = shm.register(pool)  # once, as a worker registers its KV pool

    def pull(engine: TransferEngine, size: int) -> int:
        """The first ``size`` bytes of blocks, block i of A's segment into block i of the
        pool: one (remote offset, local offset, nbytes) range per block, built per pull."""
        return engine.read_ranges(endpoint, local, [(o, o, BLOCK) for o in range(0, size, BLOCK)])

    assert shm.backend_for(endpoint) == "shm" and tcp.backend_for(endpoint) == "tcp"
    mirror = shm._backends["shm"].segment(endpoint).array  # to check the bytes arrived
    results = {}
    for size_mib in sizes:
        size = size_mib * MiB
        n = repeats(size_mib)
        pool[:size] = 0
        ok = pull(shm, size) == size and bool(np.array_equal(pool[:size], mirror[:size]))
        t_memcpy, t_shm = best_interleaved(
            [lambda s=size: np.copyto(pool[:s], source[:s]), lambda s=size: pull(shm, s)], n
        )
        pool[:size] = 0
        moved = pull(tcp, size)
        ok = ok and moved == size and bool(np.array_equal(pool[:size], mirror[:size]))
        t_tcp = best(lambda s=size: pull(tcp, s), max(3, n // 4))
        results[size_mib] = dict(memcpy=t_memcpy, shm=t_shm, tcp=t_tcp, ok=ok)
    shm.close()
    tcp.close()
    conn.send(results)


def ray_times(sizes: list[int]) -> dict[int, float]:
    import ray

    with local_ray(num_cpus=2):

        @ray.remote(num_cpus=0)
        class Producer:
            def __init__(self, total: int) -> None:
                self.data = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)

            def emit(self, size: int) -> np.ndarray:
                return self.data[:size]

        @ray.remote(num_cpus=0)
        class Consumer:
            def __init__(self, total: int) -> None:
                self.pool = np.ones(total, dtype=np.uint8)

            def take(self, arr: np.ndarray) -> int:
                np.copyto(self.pool[: arr.size], arr)
                return int(arr.size)

        total = max(sizes) * MiB
        prod, cons = Producer.remote(total), Consumer.remote(total)
        ray.get([prod.emit.remote(1), cons.take.remote(np.zeros(1, np.uint8))])  # warm up
        out = {}
        for size_mib in sizes:
            size = size_mib * MiB
            out[size_mib] = best(
                lambda s=size: ray.get(cons.take.remote(prod.emit.remote(s))),
                max(3, repeats(size_mib) // 4),
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 256], help="MiB")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray object-store column")
    args = ap.parse_args()
    sizes = sorted(args.sizes)
    ctx = mp.get_context("spawn")
    a_conn, a_child = ctx.Pipe()
    b_conn, b_child = ctx.Pipe()
    a = ctx.Process(target=holder, args=(a_child, max(sizes) * MiB))
    a.start()
    endpoint = a_conn.recv()
    b = ctx.Process(target=puller, args=(b_child, endpoint, sizes))
    b.start()
    results = b_conn.recv()
    b.join()
    a_conn.send("done")
    a.join()
    ray_t = {} if args.no_ray else ray_times(sizes)

    def gbs(size_mib: int, t: float) -> float:
        return size_mib * MiB / t / 1e9

    head = f"{'MiB':>5} {'memcpy GB/s':>12} {'shm GB/s':>9} {'shm/memcpy':>10} "
    head += f"{'tcp GB/s':>9} {'tcp/memcpy':>10} {'ray GB/s':>9} {'ray/memcpy':>10} {'bytes':>6}"
    print(head)
    worst = 1.0
    for s in sizes:
        r = results[s]
        mem, shm, tcp = gbs(s, r["memcpy"]), gbs(s, r["shm"]), gbs(s, r["tcp"])
        ray_col = f"{gbs(s, ray_t[s]):>9.2f} {gbs(s, ray_t[s]) / mem:>10.2f}" if ray_t else ""
        print(
            f"{s:>5} {mem:>12.2f} {shm:>9.2f} {shm / mem:>10.2f} {tcp:>9.2f} {tcp / mem:>10.2f} "
            f"{ray_col} {'same' if r['ok'] else 'DIFF':>6}"
        )
        if s >= 16:
            worst = min(worst, shm / mem)
    verdict = "meets" if worst >= 0.8 else "misses"
    print(f"shm >= 16 MiB: worst {worst:.2f} x memcpy ({verdict} the 0.80 target)")


if __name__ == "__main__":
    main()
