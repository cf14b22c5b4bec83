"""The defaults that carry the benches' speed to a plain config, each named once here with
the measurement that chose it. ``EngineConfig``, ``PDClusterConfig``, the Serve config's
replica groups and the replica loop read them from this module; docs/configuration.md
points here.

``ENGINE_NICE`` (0): every engine thread (colocated, prefill, decode replica loops; MoE
attention and expert workers' rounds) runs at this nice value whatever Ray's
``worker_niceness`` (15 unless RAY_worker_niceness is set), so a nice-0 process on the node
(a load generator, another server) no longer takes the engine's core
(``thread_priority``). Where the process may not raise a thread's priority, one logged
line says how (RAY_worker_niceness=0, CAP_SYS_NICE, or ``ulimit -e 20``).

``PIN_CORES`` (True): on a one-node Ray cluster whose cores are at least its replicas,
replicas get disjoint cores (``replica_loop.disjoint_cores``) and as many torch threads as
cores: a Serve app's colocated replicas one run each (``actors.serving.core_plan``), a P/D
cluster's prefill replicas one half and its decode replicas the other
(``replica_loop.split_cores``). ``pin_cores: false`` (a replica group, or
``PDClusterConfig``) turns it off.

``TOKEN_BUDGET``: tokens per engine step (prefill chunks and decodes together) and so the
largest prefill chunk. On CPU the torch attention backend pads every decode row of a mixed
step to the chunk's length, so a step with a long chunk stalls every running decode: on
SmolLM2-135M with 31 running decodes, a step with a 512-token chunk took 878 ms against
130 ms for the decodes alone (459 ms at 256). ``CHUNK_SIZE`` (None: the budget) caps one
request's chunk below the budget. Chosen from the sweep in docs/configuration.md
("Defaults and the measurements that chose them").
"""

from __future__ import annotations

ENGINE_NICE = 0
PIN_CORES = True
TOKEN_BUDGET = 2048
CHUNK_SIZE: int | None = None
