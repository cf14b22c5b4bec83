"""Prefill and decode as two processes sharing one GPU, against the single process (issue 40).

The decode process keeps its paged cache on the device and exports it through CUDA IPC
(``DeviceKVCache``); the prefill process maps it (``IPCRoute``) and copies each layer's
blocks device to device as the layer is computed; the decode process admits each request
as its receipts arrive, between its steps. Plain spawned processes, no Ray (as in
``tests/gpu/test_pd_one_gpu.py``, whose exactness check this bench does not repeat).

The workload is what disaggregation is for: ``--background`` requests decode (short
prompts, ``--background-tokens`` new tokens each); after ``--warm-steps`` of their decode
steps, ``--long`` long prompts (``--long-prompt`` tokens) arrive. Reported, for the single
process (the long prompts' chunks mixed into the decode steps) and for P/D:

- TBT: the background requests' gaps between tokens, before the long prompts arrive and
  while they are prefilled (from their arrival to the last one's first token), p50 / max;
- TTFT: the long prompts', from their arrival to the first token at the decode side;
- greedy tokens that differ between the two layouts (bfloat16 on the GPU: a near-tie can
  flip when the batch differs; not asserted here).

Then the device-to-device copy bandwidth of ``KVCacheImport.write_blocks`` (a second,
spawned process writes ``--copy-blocks`` blocks of every layer into the exported cache;
bytes read plus written) against a plain device-to-device copy in the same run. On the CPU
(a dry run of the plumbing, float32) the bandwidth part is left out, saying so.

    python bench/pd_one_gpu.py [--model SmolLM2-135M-Instruct] [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import random
import socket
import statistics
import time
from typing import Any

import torch

from bench.child_process import WAIT_S, expect, guarded


@dataclasses.dataclass(frozen=True)
class Workload:
    background: list[list[int]]
    long: list[list[int]]
    background_tokens: int
    long_tokens: int
    warm_steps: int

    def requests(self, build: Any) -> list[Any]:
        from actors.engine.sampling import SamplingParams

        def greedy(n: int) -> Any:
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

        bg = [
            build.build(p, greedy(self.background_tokens), request_id=f"bg{i}")
            for i, p in enumerate(self.background)
        ]
        long = [
            build.build(p, greedy(self.long_tokens), request_id=f"long{i}")
            for i, p in enumerate(self.long)
        ]
        return bg + long


@dataclasses.dataclass
class Timeline:
    """Token arrival times (``time.monotonic``, one clock for every process on the host)."""

    tokens: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    outputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    arrived: float = 0.0  # when the long prompts arrived

    def record(self, request_id: str, n: int, at: float) -> None:
        self.tokens.setdefault(request_id, []).extend([at] * n)

    def summary(self) -> dict[str, float]:
        long = {k: v for k, v in self.tokens.items() if k.startswith("long")}
        ttft = [v[0] - self.arrived for v in long.values()]
        window_end = max(v[0] for v in long.values())
        before, during = [], []
        for k, times in self.tokens.items():
            if not k.startswith("bg"):
                continue
            for a, b in zip(times, times[1:], strict=False):  # one token a step
                if b <= self.arrived:
                    before.append(b - a)
                elif b <= window_end:
                    during.append(b - a)
        ms = 1e3
        return {
            "tbt_before_p50": statistics.median(before) * ms,
            "tbt_during_p50": statistics.median(during) * ms,
            "tbt_during_max": max(during) * ms,
            "ttft_p50": statistics.median(ttft) * ms,
            "ttft_max": max(ttft) * ms,
        }


def step_and_record(c: Any, t: Timeline) -> None:
    """One step of controller ``c``: its tokens into ``t``, finished requests released."""
    deltas = c.step()
    now = time.monotonic()
    for d in deltas:
        t.record(d.request_id, len(d.token_ids), now)
        if d.finished:
            t.outputs[d.request_id] = c.release(d.request_id).token_ids


def model_config(model: str | None) -> Any:
    """``model``'s config (None: the random dense test model's)."""
    from models import tiny_model_dir
    from models.config import read_model_config

    return read_model_config(model or tiny_model_dir("dense"))


def model_shape(model: str | None) -> tuple[int, int]:
    cfg = model_config(model)
    return cfg.num_hidden_layers, cfg.num_key_value_heads


def single_process(model: str | None, opts: dict[str, Any], work: Workload) -> Timeline:
    """Everything in one engine: the long prompts' chunks join the background's decode steps."""
    from actors.engine.replica_controller import ReplicaController

    c = ReplicaController.build(model, **opts)
    reqs = work.requests(c.request_builder())
    bg, long = reqs[: len(work.background)], reqs[len(work.background) :]
    t = Timeline()
    for r in bg:
        c.add_request(r)
    steps_decoding = 0
    added_long = False
    while c.has_unfinished() or not added_long:
        if not added_long and steps_decoding >= work.warm_steps:
            t.arrived = time.monotonic()
            for r in long:
                c.add_request(r)
            added_long = True
        step_and_record(c, t)
        if all(r.request_id in t.tokens for r in bg):
            steps_decoding += 1
    c.shutdown()
    return t


def _decode(
    conn: Any, admissions: Any, model: str | None, opts: dict[str, Any], work: Workload
) -> None:
    guarded(_decode_body, conn, admissions, model, opts, work)


def _decode_body(
    conn: Any, admissions: Any, model: str | None, opts: dict[str, Any], work: Workload
) -> None:
    """Reserve every request's blocks and send their destinations; then admit each request
    whose receipts arrive (between steps) and decode; tell the parent once the background
    has decoded ``warm_steps`` steps; send the timeline at the end."""
    from actors.disagg.kv_stream import KVDestination, SharedKVCache
    from actors.engine.replica_controller import ReplicaController
    from actors.engine.worker_hooks import WorkerHooks
    from store.kv_cache_ipc import accept_receipt

    layers, heads = model_shape(model)
    node = socket.gethostname()
    if opts["device"] == "cpu":  # the dry run: the decode worker's shared-memory segment
        cache: Any = SharedKVCache("decode-d-0.0.0", node, (0, layers), (0, heads), export=True)
    else:
        from actors.disagg.device_kv_cache import DeviceKVCache

        cache = DeviceKVCache("decode-d-0.0.0", node, (0, layers), (0, heads))
    c = ReplicaController.build(model, worker_hooks=WorkerHooks(kv_cache=cache), **opts)
    (target,) = c.executor.hook_info()
    export = dataclasses.replace(target.export, weight_version=c.weight_version)
    target = dataclasses.replace(target, export=export)
    dests = []
    for request in work.requests(c.request_builder()):
        blocks = c.reserve_prefilled(request)
        assert blocks is not None, "no room for the reservation: raise --num-blocks"
        dests.append((request, KVDestination((target,), tuple(blocks))))
    conn.send(("dests", dests))
    t = Timeline()
    n_requests, admitted, told = len(dests), 0, False
    bg_ids = {r.request_id for r, _ in dests[: len(work.background)]}
    steps_decoding = 0
    while admitted < n_requests or c.has_unfinished():
        wait = 0.0 if c.has_unfinished() else 1.0
        while admissions.poll(wait):
            key, first_token, receipts, arrived = admissions.recv()
            for done in receipts:  # written into this cache, of its generation and weights
                accept_receipt(export, done)
            delta = c.admit_prefilled(key, first_token)
            t.record(key, 1, time.monotonic())
            t.arrived = arrived or t.arrived
            admitted += 1
            if delta.finished:
                t.outputs[key] = c.release(key).token_ids
            wait = 0.0
        if not c.has_unfinished():
            continue
        step_and_record(c, t)
        if bg_ids <= t.tokens.keys():
            steps_decoding += 1
            if steps_decoding >= work.warm_steps and not told:
                conn.send(("warm",))
                told = True
    conn.send(("timeline", t))
    conn.recv()  # the parent is done with us: exit (the prefill closed its mapping)
    c.shutdown()


def _prefill(conn: Any, admissions: Any, model: str | None, opts: dict[str, Any]) -> None:
    guarded(_prefill_body, conn, admissions, model, opts)


def _prefill_body(conn: Any, admissions: Any, model: str | None, opts: dict[str, Any]) -> None:
    """Prefill each batch the parent sends into the decode process's cache, all of a batch
    at once; send each request's first token and receipts to the decode process as soon as
    its prompt is done."""
    from actors.disagg.kv_ipc_route import IPCRoute
    from actors.disagg.kv_stream import LayerStreamer, StreamHook
    from actors.engine.replica_controller import ReplicaController
    from actors.engine.worker_hooks import PrivateKVCache, WorkerHooks
    from store.transfer import TransferEngine

    layers, heads = model_shape(model)
    node = socket.gethostname()
    route = IPCRoute(node, (0, layers), (0, heads), strict=True)  # never the transfer layer
    engine = TransferEngine("prefill-p", node)
    streamer = LayerStreamer(engine, opts["block_size"], (0, heads), (0, heads), route)
    c = ReplicaController.build(
        model, worker_hooks=WorkerHooks(PrivateKVCache(), StreamHook(streamer)), **opts
    )
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, batch, is_arrival = msg
        arrived = time.monotonic() if is_arrival else 0.0
        receipts: dict[str, list[Any]] = {}
        for request, dest in batch:
            first = dataclasses.replace(request.params, max_tokens=1, stop=[])
            dest = dataclasses.replace(dest, weight_version=c.weight_version)
            c.add_request(dataclasses.replace(request, params=first), kv_dest=dest)
        while c.has_unfinished():
            deltas = c.step()
            for report in c.take_hook_reports():
                assert not report.failed, report.failed
                for key, got in report.receipts.items():
                    receipts.setdefault(key, []).extend(got)
            for d in deltas:
                if d.finished:
                    token = c.release(d.request_id).token_ids[0]
                    done = tuple(receipts.pop(d.request_id, ()))
                    admissions.send((d.request_id, token, done, arrived))
    streamer.close()  # drops the mapping: the decode process may free its cache
    conn.send(("done", route.opens, route.bytes_written, engine.chosen_backends()))
    c.shutdown()
    engine.close()


def two_processes(model: str | None, opts: dict[str, Any], work: Workload) -> tuple[Timeline, int]:
    """P/D: returns the decode side's timeline and the bytes written device to device."""
    ctx = mp.get_context("spawn")
    to_decode, decode_end = ctx.Pipe()
    to_prefill, prefill_end = ctx.Pipe()
    admissions_in, admissions_out = ctx.Pipe(duplex=False)
    decode = ctx.Process(
        target=_decode, args=(decode_end, admissions_in, model, opts, work), daemon=True
    )
    prefill = ctx.Process(
        target=_prefill, args=(prefill_end, admissions_out, model, opts), daemon=True
    )
    decode.start()
    prefill.start()
    try:
        (dests,) = expect(to_decode, "dests", decode)
        expect(to_prefill, "ready", prefill)
        n_bg = len(work.background)
        to_prefill.send(("batch", dests[:n_bg], False))
        expect(to_decode, "warm", decode)
        to_prefill.send(("batch", dests[n_bg:], True))
        (timeline,) = expect(to_decode, "timeline", decode)
        to_prefill.send(("stop",))
        opens, written, backends = expect(to_prefill, "done", prefill)
        assert opens == 1 and backends == {}, (opens, backends)  # one mapping, no transfers
        to_decode.send("bye")
        for proc in (prefill, decode):
            proc.join(WAIT_S)
            assert proc.exitcode == 0, proc.exitcode
    finally:
        for proc in (decode, prefill):
            if proc.is_alive():
                proc.kill()
    return timeline, written


def _ipc_writer(export: Any, layout: Any, blocks: int, repeats: int, conn: Any) -> None:
    """Map the exported cache and time ``repeats`` writes of ``blocks`` blocks, every layer."""
    from kernels.kv_cache import allocate_kv_cache
    from store.kv_cache_ipc import KVCacheImport

    src = allocate_kv_cache(
        layout.num_layers,
        blocks,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
        layout.dtype,
        torch.device("cuda"),
    )
    ids = list(range(blocks))
    dst = random.Random(0).sample(range(2 * blocks), blocks)  # scattered, as a paged cache's
    with KVCacheImport.open(export, layout, weight_version=None) as imp:
        imp.write_blocks(src, ids, dst)
        imp.complete(dst)
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = imp.write_blocks(src, ids, dst)
            imp.complete(dst)
            times.append(time.perf_counter() - t0)
    conn.send(("bandwidth", n, statistics.median(times)))


def ipc_write_bandwidth(
    model: str | None, blocks: int, block_size: int, repeats: int = 10
) -> tuple[float, int]:
    """Bytes/s (read + written) of a spawned process's ``write_blocks`` into this process's
    exported cache of the model's shape (bfloat16), and the bytes of one write."""
    from kernels.kv_cache import allocate_kv_cache
    from store.kv_cache_ipc import KVCacheExporter

    cfg = model_config(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    caches = allocate_kv_cache(
        cfg.num_hidden_layers,
        2 * blocks,
        block_size,
        cfg.num_key_value_heads,
        head_dim,
        torch.bfloat16,
        torch.device("cuda"),
    )
    exporter = KVCacheExporter("decode-bw", caches)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_ipc_writer,
        args=(exporter.export(), exporter.layout, blocks, repeats, child),
        daemon=True,
    )
    proc.start()
    try:
        n, seconds = expect(parent, "bandwidth", proc)
        proc.join(WAIT_S)
    finally:
        if proc.is_alive():
            proc.kill()
    return 2 * n / seconds, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="SmolLM2-135M-Instruct", help="'tiny': the random dense test model"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--background", type=int, default=16)
    ap.add_argument("--background-prompt", type=int, default=64)
    ap.add_argument("--background-tokens", type=int, default=96)
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--warm-steps", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=2048)
    ap.add_argument("--copy-blocks", type=int, default=1024)
    ap.add_argument("--bandwidth-only", action="store_true", help="the copy bandwidth alone")
    args = ap.parse_args()

    from models.pretrained import resolve_model

    model = None if args.model == "tiny" else str(resolve_model(args.model))
    cuda = args.device == "cuda"
    opts: dict[str, Any] = dict(
        device=args.device,
        dtype=torch.bfloat16 if cuda else torch.float32,
        attention_backend="torch",
        block_size=16,
        num_blocks=args.num_blocks,
        # the long prompts' chunks as large as the budget allows beside the decodes, as the
        # GPU figures recorded in tests/gpu/README.md were measured (128 is a CPU default)
        prefill_beside_decodes=None,
    )
    if args.bandwidth_only:
        print_bandwidth(model, args.copy_blocks)
        return
    vocab = model_config(model).vocab_size
    rng = random.Random(0)
    work = Workload(
        background=[
            [rng.randrange(3, vocab) for _ in range(args.background_prompt)]
            for _ in range(args.background)
        ],
        long=[[rng.randrange(3, vocab) for _ in range(args.long_prompt)] for _ in range(args.long)],
        background_tokens=args.background_tokens,
        long_tokens=4,
        warm_steps=args.warm_steps,
    )
    print(f"model: {args.model} on {args.device} in {opts['dtype']}, torch attention backend")
    print(
        f"{args.background} requests decode ({args.background_prompt}-token prompts, "
        f"{args.background_tokens} tokens each); after {args.warm_steps} of their steps "
        f"{args.long} prompts of {args.long_prompt} tokens arrive"
    )
    single_process(model, opts, work)  # warm-up: kernels, allocator
    one = single_process(model, opts, work)
    pd, written = two_processes(model, opts, work)
    cols = ("TBT p50 before", "TBT p50 during", "TBT max during")
    print(f"{'layout':<16}" + "".join(f" {c:>15}" for c in cols) + "  TTFT p50  TTFT max  (ms)")
    for name, t in (("single process", one), ("P/D, 2 procs", pd)):
        s = t.summary()
        print(
            f"{name:<16} {s['tbt_before_p50']:>15.1f} {s['tbt_during_p50']:>15.1f} "
            f"{s['tbt_during_max']:>15.1f} {s['ttft_p50']:>9.1f} {s['ttft_max']:>9.1f}"
        )
    differ = sum(one.outputs[k] != pd.outputs[k] for k in one.outputs)
    print(
        f"P/D wrote {written / 1e6:.1f} MB of KV device to device; greedy outputs that "
        f"differ from the single process: {differ} of {len(one.outputs)}"
    )
    if not cuda:
        print("copy bandwidth: CUDA only (this was a dry run on the CPU)")
        return
    print_bandwidth(model, args.copy_blocks)


def print_bandwidth(model: str | None, blocks: int) -> None:
    from bench.decode_gpu import copy_bandwidth

    plain = copy_bandwidth()
    ipc, n = ipc_write_bandwidth(model, blocks, 16)
    print(
        f"device-to-device KV write through CUDA IPC: {ipc / 1e12:.2f} TB/s (read + write, "
        f"{n / 1e6:.0f} MB a write); a plain device copy: {plain / 1e12:.2f} TB/s; "
        f"ratio {ipc / plain:.2f}"
    )


if __name__ == "__main__":
    main()
