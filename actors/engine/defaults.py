"""The defaults that carry the benches' speed to a plain config, each named once here; the
measurements that chose them are in docs/configuration.md ("Defaults and the measurements
that chose them"). ``EngineConfig``, ``PDClusterConfig``, the Serve config's replica groups
and ``thread_priority`` read them from this module.

``ENGINE_NICE`` (0): every engine thread (colocated, prefill, decode replica loops; MoE
attention and expert workers' rounds) runs at this nice value whatever Ray's
``worker_niceness`` (15 unless RAY_worker_niceness is set), and so does every thread of the
Serve app's ingress, router and replica processes and of a P/D cluster's prefill and decode
replica processes, whose Conductor long poll and Ray reply threads carry every token
(``thread_priority``; ``looped_replica``). Where a process
may not raise a priority, one logged line says how (RAY_worker_niceness=0, CAP_SYS_NICE,
``ulimit -e 20``).

``PIN_CORES`` (True): on a one-node Ray cluster with at least as many cores as replicas,
replicas get disjoint cores and as many torch threads as cores: a Serve app's colocated
replicas one run each of ``replica_loop.disjoint_cores`` (``actors.serving.core_plan``; a
single replica keeps the whole node), a P/D cluster's prefill replicas one half and its
decode replicas the other (``replica_loop.split_cores``). ``pin_cores: false`` (a replica
group, or ``PDClusterConfig``) leaves the engine threads to the OS.

``TOKEN_BUDGET`` (512): tokens per engine step, prefill chunks and decodes together, so
also the largest chunk. The torch attention backend pads every decode row of a mixed step
to the chunk's length, so a long chunk stalls every running decode; 2048 served 2-3% more
requests/s than 512 on the bench model but doubled TTFT. ``CHUNK_SIZE`` (None: the budget)
caps one request's chunk below it.

``PREFILL_BESIDE_DECODES`` (128): prompt tokens a step may carry while decodes run in it (a
step without decodes takes the whole budget). A decode's gap between tokens is its step's
time, and a step's prompt tokens set that time: on SmolLM2-135M with ShareGPT at 32
streams (two replicas, a bench client that did not wait for a CPU, three interleaved runs
beside vLLM 0.32, 2026-11-30), the p99 gap between tokens was 723 ms with 512 prompt
tokens a step, 445 ms with 256 and 255 ms with 128 (vLLM's 171-184 ms, a server that had
served those prompts before, docs/benchmarks.md "A peer's prefix cache"), at the same
requests/s (1.03x, 1.10x, 1.05x vLLM's); Medha's relative target (``decode_slowdown: 5``)
read 306 ms in the same hour. A cap scaled by the decodes (2048 / d prompt tokens beside d
decodes) read 452 ms at 32 streams and 0.81x vLLM's requests/s at 8 streams, against the
flat cap's 248 ms and 0.91x, so it was not kept. At 8 streams four invocations alternating
no cap and this one read 0.86-0.94x vLLM's requests/s either way. Fixed and deterministic:
a prompt's chunks depend on the steps' contents, never on measured times. A CPU figure: a
GPU step carries thousands of prompt tokens in the time a CPU takes for a hundred
(``prefill_beside_decodes: null``).

``DECODE_SLOWDOWN`` (None: fixed chunks): ``decode_slowdown: k`` sizes prompt chunks so a step
beside decodes is predicted to take at most k times the decodes' own step (Medha's batch
packer with a target relative to the replica's measured steps, ``policies.batch_packer``;
no per-model figure, and the predictor's cold start cancels out). Not the default: on
SmolLM2 with ShareGPT at 32 streams, k = 2 served 1.65 req/s against fixed chunks' 2.04 in
the same hour (three interleaved runs each beside vLLM, 2026-11-29) and did not shorten
the client's p99 gap between tokens (2.5 s against 2.2 s): prompts then prefill at about
half the engine's pace while decodes run, the decode batch thins, and the tail is not the
long mixed steps alone (docs/benchmarks.md).

``REPORT_INTERVAL_S`` (0.5 s): how often a busy Serve replica pushes its block events, stats
and metrics to the router deployment (an idle one every 2 s). Each push is a Serve handle
call that costs the replica's Python threads and the router's; the router records its own
routing decisions at once, so a push only confirms them. At 0.1 s the pushes took 0.06 of a
core more than at 0.5 s in `bench/serve.py --defaults` at 8 streams on this 2-core machine.
``REGION_REPORT_INTERVAL_S`` (0.1 s): the same with a ``regions`` section, whose balancers
place each request by its region's waiting counts, which these pushes carry: at 0.5 s a
second request sent right after the first found its region still full and was forwarded.

``DECODE_WAIT_S`` (30 s) and ``DECODE_WAIT_MAX`` (64): a disaggregated request that finds no
decode room waits in a FIFO at the Conductor (``policies.decode_wait``) at most this long,
and at most this many wait at once; past either it gets the 429 it got before the queue.
``PDClusterConfig(decode_wait_s=0)`` refuses at once, as before.

``STORE_MIN_LOAD_TOKENS`` (32): a colocated replica with a KV store (a colocated group's
``store`` section, ``min_load_tokens``) loads a stored prefix only when it brings at least
this many tokens; fewer are computed. ``bench/colocated_store.py`` times one request that
computes N + 1 tokens against the same request loading N tokens' blocks from a shard on
its node and computing the last one: on SmolLM2-135M loading won from N = 32 in three runs
(load/compute 0.74, 0.71, 0.86 there; 1.18, 0.93, 1.17 at N = 16), on the 4-layer test
model only from N = 256 (a load costs about 3-5 ms of store calls, that model computes 128
tokens in about 3 ms).

``BATCH_MAX_IN_FLIGHT`` (256): requests ``LLM(model, num_replicas=k)`` and the rollout job
(``python -m actors.rollout``) keep submitted at once, for batch work: a replica's decode
batch is what it holds, and a larger batch spreads each step's weight reads and Python over
more tokens. ``bench/rollout.py``'s workload (SmolLM2, 128 ShareGPT prompts, 2 replicas)
generated 460 tok/s at 256 against 348 at 32 (the former default), one run each; one
replica at 256 gave 250.
"""

from __future__ import annotations

ENGINE_NICE = 0
PIN_CORES = True
TOKEN_BUDGET = 512
PREFILL_BESIDE_DECODES: int | None = 128
CHUNK_SIZE: int | None = None
DECODE_SLOWDOWN: float | None = None
REPORT_INTERVAL_S = 0.5
REGION_REPORT_INTERVAL_S = 0.1
DECODE_WAIT_S = 30.0
DECODE_WAIT_MAX = 64
STORE_MIN_LOAD_TOKENS = 32
BATCH_MAX_IN_FLIGHT = 256


def report_interval_for(regions: bool) -> float:
    """The report interval of a Serve config without its own: with or without ``regions``."""
    return REGION_REPORT_INTERVAL_S if regions else REPORT_INTERVAL_S
