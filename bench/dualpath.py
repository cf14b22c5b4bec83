"""DualPath, live on the CPU engine: does a multi-turn agentic workload finish sooner when
stored prefixes are read through both the prefill and the decode side's storage links than
through the prefill side's alone? And do model-execution messages keep their latency
while KV transfers fill a link?

Workload (agentic, shaped like the paper's at toy scale): ``--conversations`` conversations
of ``--turns`` turns; turn 1 is a ``--first``-token prompt, every later turn is the whole
previous context, the previous answer and a ``--append``-token message; answers are
``--output`` tokens (greedy). All conversations' turn t run together; before each turn
the prefill replica forgets its own prefix cache (as a prefill engine's HBM would not
hold them), so every reused prefix comes from the KV store, where decode replicas wrote
each block back as it filled (``StoreConfig(write_back=True)``).

Links: every replica stands for its own node, with a storage link of ``--storage-mbps``
and a compute link of ``--compute-mbps`` (token buckets: ``store.transfer.links``). One
prefill and one decode replica (tiny dense model, fp32, block 16). Two deployments,
interleaved (A, B, A, B, ...), medians reported:

- prefill-path: every stored prefix is read through the prefill replica's storage link;
- dual-path: per request, the side with the shorter read queue (``read_path="dual"``):
  the decode replica's reads go storage -> its cache -> the prefill replica, layer by
  layer, over the compute link.

Completion time is from turn 2's start to the last turn's end (turn 1 reads nothing).
Tokens must be identical in every run.

Model-execution messages: on one emulated compute link, 16 KB messages every 5 ms while
four threads push KV through it; the message latency is measured with the two traffic
classes (messages first) and with messages queued as KV (no classes), against the idle
link. This is the link alone, not the engine's collectives (a tp=1 CPU replica has none).

The last line is ``completion-time prefill-path/dual-path: <ratio>``.

``--skew S``: skewed storage bandwidth, the prefill replica's storage link at ``S`` times
the decode replica's (``--storage-mbps``). The same two deployments are then the naive
choice (always the prefill path, the paper's Basic) and the scheduler's read path
(``"dual"``: with both links' rates known, the side whose read would end first,
``policies.dualpath.pick_path``); the links carry the model's own traffic too (the
prefill -> decode KV stream on the prefill replica's compute link, both sides' store
writes on their storage links). The last line is then ``dualpath scheduler/naive:
<ratio>``, a throughput ratio (same turns, naive completion time / scheduler's).

``--model M --dataset sharegpt``: a real model (a ``.gguf``, a folder or a packaged name)
and ShareGPT conversations with ``--turns`` user turns, each turn appended in the model's
chat template after the model's own answer. A real model's KV is larger per token (46 KB
for SmolLM2-135M against the tiny model's 1 KB): scale the links with it to keep the
tiny run's reads-per-second regime (e.g. ``--storage-mbps 45 --compute-mbps 720``), and
``--store-mib`` so that every conversation's prefix fits the store.

    python bench/dualpath.py [--repeats 3] [--model M --dataset sharegpt] [--skew 0.25]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from dataclasses import replace

import ray

from actors.disagg.cluster import PDCluster
from actors.disagg.cluster_config import PDClusterConfig, PDSideConfig
from actors.disagg.store_view import StoreConfig
from actors.engine.config import EngineConfig
from actors.engine.sampling import SamplingParams
from bench.interleave import interleaved
from bench.local_serve import local_ray
from bench.real_prompts import add_model_options, chosen_model
from store.transfer.links import EXEC, KV, Link, LinkBudget

ENGINE = dict(block_size=16, num_blocks=1024, chunk_size=256, token_budget=512)


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each conversation's first prompt and its later user turns' tokens (turns 2..):
    random ids, or with ``--dataset sharegpt`` ShareGPT conversations' user turns in the
    model's chat template."""
    rng = random.Random(args.seed)
    if args.dataset == "random":
        firsts = [
            [rng.randrange(3, 500) for _ in range(args.first)] for _ in range(args.conversations)
        ]
        appends = [
            [[rng.randrange(3, 500) for _ in range(args.append)] for _ in range(args.turns - 1)]
            for _ in range(args.conversations)
        ]
        return firsts, appends
    from bench.real_prompts import chat_ids, dialogues, tokenizer, turn_ids

    tok = tokenizer(args.model)
    convs = dialogues(args.turns, args.conversations, args.seed)
    firsts = [chat_ids(tok, c[0]) for c in convs]
    appends = [[turn_ids(tok, t) for t in c[1:]] for c in convs]
    return firsts, appends


def conversation_run(args: argparse.Namespace, read_path: str) -> tuple[float, list, dict]:
    """One deployment through the whole workload: (completion time of turns 2.., every
    answer, counters)."""
    budget = LinkBudget(
        storage_bps=args.storage_mbps * 1e6,
        compute_bps=args.compute_mbps * 1e6,
        chunk_bytes=16 << 10,
    )
    share = args.skew if args.skew is not None else 1.0
    prefill_budget = replace(budget, storage_bps=args.storage_mbps * 1e6 * share)
    pd = PDCluster(
        PDClusterConfig(
            model_dir=args.model_dir,
            engine=EngineConfig(**ENGINE),
            prefill=PDSideConfig(link_budget=prefill_budget),
            decode=PDSideConfig(link_budget=budget),
            store=StoreConfig(dram_bytes=args.store_mib << 20, write_back=True),
            read_path=read_path,
            fit_costs=False,
        )
    )
    contexts, appends = workload(args)
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    answers: list[list[int]] = []
    cached = 0
    start = 0.0
    try:
        for turn in range(args.turns):
            if turn == 1:
                start = time.perf_counter()
            ray.get([h.drop_local_cache.remote() for h in pd.prefills.values()])
            outs = pd.generate(prompt_token_ids=contexts, sampling_params=params)
            for i, out in enumerate(outs):
                answers.append(out.token_ids)
                if turn > 0:
                    cached += out.num_cached_tokens
                if turn + 1 < args.turns:
                    contexts[i] = contexts[i] + out.token_ids + appends[i][turn]
        seconds = time.perf_counter() - start
        decode_loaded = sum(
            ray.get(h.report_stats.remote()).loaded_blocks for h in pd.decodes.values()
        )
        counters = {
            "paths": dict(pd.path_counts),
            "cached_tokens": cached,
            "prefill_loaded": sum(s.loaded_blocks for s in pd.prefill_stats().values()),
            "decode_loaded": decode_loaded,
            "storage_kv_bytes": {  # reads and writes (the model's own write-back too)
                rid: ray.get(h.link_bytes.remote()).get("storage", {}).get("kv", 0)
                for rid, h in [*pd.prefills.items(), *pd.decodes.items()]
            },
        }
    finally:
        pd.shutdown()
    return seconds, answers, counters


def message_latency(classes: bool, load: bool, seconds: float = 1.5) -> float:
    """Median latency (ms) of 16 KB messages every 5 ms on a 20 MB/s link, with four KV
    streams pushing through it (``load``), as EXEC (``classes``) or queued as KV."""
    link = Link("compute", 20e6, burst_bytes=64 << 10, chunk_bytes=16 << 10, kv_floor=0.01)
    stop = threading.Event()
    payload = bytearray(16 << 10)
    sink = bytearray(16 << 10)

    def kv_stream() -> None:
        while not stop.is_set():
            link.acquire(len(payload), KV)
            sink[:] = payload  # the real copy

    threads = [threading.Thread(target=kv_stream) for _ in range(4 if load else 0)]
    for t in threads:
        t.start()
    latencies = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        link.send(16 << 10, EXEC if classes else KV)
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.005)
    stop.set()
    for t in threads:
        t.join()
    return statistics.median(latencies) * 1e3


def report_skewed(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    """The skewed-storage comparison: the naive choice (always the prefill path) against
    the scheduler's read path (``read_path="dual"``: the side whose read ends first, the
    links' rates known); throughput = the same turns / completion time."""
    pp, dp = statistics.median(times["prefill"]), statistics.median(times["dual"])
    share = args.skew
    print(
        f"\nskewed storage: prefill link {args.storage_mbps * share:g} MB/s, decode link "
        f"{args.storage_mbps:g} MB/s; median completion time (turns 2..{args.turns}) "
        f"naive (prefill path) {pp:.2f} s, scheduler (dual, rates known) {dp:.2f} s over "
        f"{args.repeats} interleaved pairs"
    )
    pairs = zip(times["prefill"], times["dual"], strict=True)
    print("per pair naive/scheduler: " + " ".join(f"{a / b:.2f}" for a, b in pairs))
    print(f"dualpath scheduler/naive: {pp / dp:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=500)
    p.add_argument("--append", type=int, default=48)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--storage-mbps", type=float, default=1.0, help="MB/s per storage link")
    p.add_argument("--compute-mbps", type=float, default=16.0, help="MB/s per compute link")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store-mib", type=int, default=256, help="the KV store's DRAM")
    p.add_argument(
        "--skew",
        type=float,
        default=None,
        help="skewed storage: the prefill replica's storage link at this share of "
        "--storage-mbps (the decode replica's at --storage-mbps); ends with "
        "'dualpath scheduler/naive'",
    )
    add_model_options(p, "sharegpt: ShareGPT conversations' user turns (--first/--append unused)")
    args = p.parse_args()
    chosen = chosen_model(p, args)
    args.model_dir = None if chosen is None else str(chosen)
    with local_ray(num_cpus=2):
        reference: list = []

        def timed(path: str, r: int) -> float:
            seconds, answers, counters = conversation_run(args, path)
            if not reference:
                reference.append(answers)
            if answers != reference[0]:
                raise SystemExit(f"tokens differ on the {path} path (repeat {r})")
            print(f"repeat {r} {path:7s}: {seconds:6.2f} s  {counters}", flush=True)
            return seconds

        times = interleaved(("prefill", "dual"), args.repeats, timed, rotate=False)  # A, B, A, B
    pp, dp = statistics.median(times["prefill"]), statistics.median(times["dual"])
    if args.skew is not None:
        report_skewed(args, times)
        return

    print("\nmodel-execution message latency (ms, 16 KB every 5 ms on a 20 MB/s link):")
    cases = {  # name -> (classes, load)
        "idle link": (True, False),
        "under KV, classes": (True, True),
        "under KV, no classes": (False, True),
    }
    lat = interleaved(list(cases), 2, lambda name, _: message_latency(*cases[name]), False)
    for name, values in lat.items():
        print(f"  {name:22s} median {statistics.median(values):7.2f}")

    print(
        f"\nmedian completion time (turns 2..{args.turns}): prefill-path {pp:.2f} s, "
        f"dual-path {dp:.2f} s over {args.repeats} interleaved pairs"
    )
    print(f"completion-time prefill-path/dual-path: {pp / dp:.2f}")


if __name__ == "__main__":
    main()
