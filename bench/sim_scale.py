"""How simulator wall time grows with cluster size.

Replays the first N requests of the Mooncake conversation trace on 16, 128 and 1,024
instances (half prefill, half decode, the Conductor), with the arrival rate scaled by
instances / 16 so per-instance load stays that of the 16-instance run. Prints wall seconds,
events, and the ratio to the 16-instance run per simulated request.

  python bench/sim_scale.py --requests 2000 --sizes 16,128,1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sim.presets import ClusterConfig, build_cluster  # noqa: E402
from sim.traces import load_trace  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--sizes", default="16,128,1024")
    p.add_argument("--mode", default="pd")
    p.add_argument("--policy", default="conductor")
    p.add_argument("--trace-dir", default=None)
    a = p.parse_args()
    base = None
    for n in (int(x) for x in a.sizes.split(",")):
        speed = n / 16
        reqs = load_trace("conversation", a.trace_dir, limit=int(a.requests * speed), speed=speed)
        cluster = build_cluster(ClusterConfig(mode=a.mode, policy=a.policy, instances=n))
        t0 = time.perf_counter()
        cluster.run(reqs)
        wall = time.perf_counter() - t0
        per = wall / len(reqs)
        base = base or per
        print(
            f"instances {n:5d}  requests {len(reqs):6d}  wall {wall:7.1f} s  "
            f"events {cluster.loop.fired:9d}  per request {1e3 * per:6.2f} ms  "
            f"(x{per / base:.2f} of 16)",
            flush=True,
        )


if __name__ == "__main__":
    main()
