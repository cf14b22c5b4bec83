"""Served throughput: the OpenAI HTTP endpoint against the in-process engine, one run.

The bench model of ``bench/bench_model.py`` (8 layers, hidden 512, random weights, fp32,
written in Hugging Face format) served two ways on the same machine, config and workload:

- HTTP: the Meridian Serve app (``serve_app.build_app``) with ONE colocated replica, driven
  through its real endpoint: ``POST /v1/completions``, streaming (SSE) with
  ``stream_options.include_usage``, by N concurrent closed-loop clients (``httpx``, each
  chunk timestamped as it arrives);
- in process: a ``ColocatedEngine`` on the same weights and engine config in an
  ``EngineLoop`` (the replica's own engine path), N client tasks in the same closed loop
  submitting built requests through ``loop.stream``.

Workload: random 256-token prompts (token ids, fresh for every run, so no prefix hits),
64 new tokens, ``ignore_eos``, greedy. Each concurrency level runs a fixed number of
requests; per level the HTTP and in-process runs alternate (HTTP, in-process, HTTP, ...),
``--repeats`` times each, and every figure printed is the median over the repeats (ranges
for throughput). Metrics as ``vllm bench serve`` reports them: TTFT from sending the
request to its first token, TPOT = (E2E - TTFT) / (output tokens - 1), ITL between
successive chunks (tokens, in process) of one request, E2E per request; throughput =
requests / wall time of the run. The HTTP client sends ``return_token_ids`` so every
token's chunk is streamed (the bench model's random weights mostly emit reserved tokens
that decode to no text; ``--no-token-ids`` for a server that rejects the field). Each
table also shows the engine's own mean inter-token gap (the replica's
``inter_token_latency`` metric, from ``/metrics``, and the same metric in process): the
HTTP path's loss split into a slower engine step (CPU and GIL contention from the per-token
relay work) and relay latency. ``--torch-threads`` (default 1, as the vLLM peer ran) holds
for both engines. ``--engine-cores`` (default: the machine's last core) pins both engines'
threads there (the engine option ``cpu_cores``) and this process, with the Ray cluster it
starts, to the other cores, so no other process preempts an engine on either side; give
the flag no value to leave scheduling to the kernel. By default the HTTP side talks to the
ingress replica's own HTTP server (Ray Serve's direct ingress,
``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``, as ``make serve`` runs it): one process hop fewer
than through Serve's proxy; ``--via-proxy`` drives the proxy's port instead.

    python bench/serve.py [--concurrency 1 8 32] [--repeats 3] [--per-stream 3]
    python bench/serve.py --base-url http://host:8000 --model NAME   # any OpenAI server
    python bench/serve.py --write-model DIR        # the bench weights, for a peer server
    python bench/serve.py --model-dir DIR --peer-url http://host:8001 --peer-model NAME
    python bench/serve.py --model-dir DIR --peer-python VLLM_VENV/bin/python

With ``--peer-url`` a third side joins the interleaving (HTTP, in process, peer, ...): a
peer OpenAI server (vLLM's CPU server, say) started on the same weights (``--write-model``
writes them; ``--model-dir`` serves that folder), driven by the same HTTP client and
workload; one more line before the last gives ``http/peer`` per concurrency.
``--peer-python`` starts that server itself (``bench/peer.py``: vLLM's API server from
that interpreter's venv, fp32, on a free port) and stops it at the end.

Last line: ``http/in-process at 32 streams: <ratio>`` (the median of the per-repeat ratios
of request throughput; targets: >= 0.85, and HTTP throughput at 32 >= at 8).

Real workloads, as ``vllm bench serve --dataset-name sharegpt|...`` runs them
(``bench/serve_chat.py``): ``--dataset sharegpt`` (first human turns; each request's
``max_tokens`` the dataset reply's length up to ``--max-output-tokens``) or ``--dataset
mtbench`` (two turns, the second sent with the first and the model's answer before it; its
TTFT reported apart), through ``/v1/chat/completions`` with the model's chat template.
Meridian serves ``--model-path`` (a ``.gguf`` file or a Hugging Face folder) from one
colocated replica (engine options as above); ``--peer-url`` adds a peer server on the same
weights, interleaved; there is no in-process side. ``--request-rate R``: Poisson arrivals
at R conversations/s, at most N in flight; else a closed loop of N streams. Goodput: the
requests per second that met ``--ttft-slo`` and ``--tpot-slo``. Each chat run also reports
the client's own wait (``bench/client_wait.py``): how late its event loop woke at most and
how long its thread sat runnable without a CPU, the part of a gap between tokens that the
client, sharing the server's cores, added itself. ``--client-nice N`` (with ``--defaults``
or ``--base-url``: every server in a session of its own) runs the client in its own
session at priority N (``bench/client_session.py``): its wait then vanishes, and what is
left of a tail is the servers'. Every invocation draws its own sample (the seed is printed;
``--seed`` repeats it), since a peer that outlives invocations keeps their prompts in its
prefix cache, and every run reports each side's prompt tokens served from its cache.

    python bench/serve.py --dataset sharegpt --model-path M.gguf --streams 8 32 \
        --peer-url http://127.0.0.1:8001 --peer-model DIR

Last line, with a peer: ``sharegpt goodput meridian/vllm at 32 streams: <ratio>``
(``mtbench second-turn TTFT meridian/vllm at N streams: <ratio>`` for MT-bench).

``--engines N`` (chat datasets) adds a side of Meridian's engines alone: N processes, each
one in-process engine on the same model at the engine's defaults, pinned to its own cores
as the app pins N colocated replicas, fed the same conversations in the same closed loop
(``bench/engine_side.py``). Before the last line it prints ``meridian/engines req/s at N
streams: <ratio>``: the share of its engines' own pace the served app keeps. Give N as
the app's replicas (2 at ``--defaults``).

``--defaults``: the server as a new user starts it (``bench/serve_defaults.py``): ``serve
run`` with the environment of the Makefile's ``serve`` recipe on a config of only the model
(``--model-dir``: the bench model; ``--model-path`` for chat) and one group, none of this
bench's engine options; sides Meridian and ``--peer-url``. The app is stopped while the
other sides run (``bench/session.paused``: at rest it takes about 0.14 of a core, which
would come out of the peer's runs), and a peer on this machine is stopped while Meridian
runs (vLLM's idle engine polls for about 10 s after a run: 0.10-0.13 of a core).
``--cpu-hog`` adds a side that
runs the same Meridian app beside a CPU-bound process at nice 0. Prints Meridian's req/s
per concurrency and whether it ever falls as streams rise; last line ``defaults
meridian/peer at <top> streams: <ratio>``, or with ``--cpu-hog`` ``cpu-hog/alone at 8
streams: <ratio>`` (issue 25: >= 0.7).

    python bench/serve.py --defaults --model-dir DIR --peer-url http://host:8001 [--cpu-hog]

``--cpu-profile`` (with ``--defaults``): around each run, every thread's CPU time on the
machine from ``/proc``, summed by part (the replicas' engine threads and their other
threads, ingress, router, Serve proxy and controller, raylet and GCS, the peer's engine and
API server, this client, other work), as cores and CPU ms per output token, with the
engine threads' wait for a core (``bench/serve_profile.py``); with a peer, the last line is
``cpu-ms per output token outside engines meridian/vllm: <ratio>`` (Meridian outside its
engine threads over the peer's API server process, at 8 streams; issue 38: <= 3).
``--group`` replaces the config's one group (a YAML mapping, default ``{name: main}``) to
try another layout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_model import MODEL, write_bench_model
from bench.client_session import rerun_as_client
from bench.local_serve import serve_app
from bench.peer import vllm_server
from bench.serve_chat import ChatClient, run_chat
from bench.serve_http import (
    HttpClient,
    Side,
    http_side,
    itl_totals,
    load,
    median_rate,
    no_itl,
    paired_ratio,
    run_sides,
    run_with_peer,
)
from bench.serve_records import Sample
from bench.session import with_peer

MODEL_NAME = "bench"


# -- the in-process side ----------------------------------------------------------------------
class InProcess:
    def __init__(self, model_dir: Path, cfg: Any, new_tokens: int) -> None:
        from actors.serving.colocated_engine import ColocatedEngine
        from actors.serving.engine_loop import EngineLoop
        from policies.request import SamplingParams

        config = cfg.groups[0].engine
        self.engine = ColocatedEngine.build(model_dir, config)
        self.loop = EngineLoop(self.engine, cfg.limits.max_waiting_per_replica, config.cpu_cores)
        self.builder = self.engine.request_builder()
        self.params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def one(self, prompt: list[int]) -> Sample:
        from actors.engine.events import Delta, Done, Failed

        t0 = time.perf_counter()
        request = self.builder.build(prompt, self.params)
        first: float | None = None
        last = t0
        itls: list[float] = []
        tokens = 0
        async for item in self.loop.stream([request]):
            now = time.perf_counter()
            if isinstance(item, Delta) and item.delta.token_ids:
                if first is None:
                    first = now
                else:
                    itls.append(now - last)
                last = now
            elif isinstance(item, Done):
                tokens = len(item.output.token_ids)
            elif isinstance(item, Failed):
                raise RuntimeError(item.message)
        end = time.perf_counter()
        assert first is not None
        return Sample(first - t0, end - t0, itls, tokens)

    def itl(self) -> tuple[float, float]:
        snap = self.loop.metrics.snapshot()
        return itl_totals((s.name, s.value) for m in snap.families for s in m.samples)

    def close(self) -> None:
        self.loop.shutdown()


# -- the Serve app ----------------------------------------------------------------------------


async def run_http_only(args: argparse.Namespace) -> None:
    token_ids = not args.no_token_ids
    client = HttpClient(args.base_url, args.model, args.new_tokens, args.api_key, token_ids)
    try:
        results = await run_sides(args, [Side("http", client.one, no_itl)])
    finally:
        await client.close()
    for c in args.concurrency:
        print(f"{c} streams: {median_rate(results, 'http', c):.2f} req/s")


async def run_both(args: argparse.Namespace, url: str, inproc: InProcess) -> None:
    client = HttpClient(url, MODEL_NAME, args.new_tokens, None, True)

    async def inproc_itl() -> tuple[float, float]:
        return inproc.itl()

    sides = [http_side("http", client), Side("in-process", inproc.one, inproc_itl)]
    results, with_peer = await run_with_peer(args, sides, client)
    head = ("streams", "http req/s", "in-proc req/s", "ratio", "ratio range")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (7, 11, 14, 6, 12), strict=True)))
    ratio_at: dict[int, float] = {}
    for c in args.concurrency:
        h, p = results[("http", c)], results[("in-process", c)]
        ratios = [a.throughput / b.throughput for a, b in zip(h, p, strict=True)]
        ratio_at[c] = statistics.median(ratios)
        rng = f"{min(ratios):.2f}-{max(ratios):.2f}"
        hm, pm = median_rate(results, "http", c), median_rate(results, "in-process", c)
        print(f"{c:>7} {hm:>11.2f} {pm:>14.2f} {ratio_at[c]:>6.2f} {rng:>12}")
    if with_peer:
        vs = [f"{paired_ratio(results, 'http', 'peer', c):.2f} at {c}" for c in args.concurrency]
        print(f"http/peer ({args.peer_model}) req/s: " + ", ".join(vs) + " streams")
    top = max(args.concurrency)
    print(f"http/in-process at {top} streams: {ratio_at[top]:.2f}")


def app_config(
    args: argparse.Namespace, model: str, model_name: str, engine_cores: list[int]
) -> dict[str, Any]:
    """One colocated replica; the engine options this bench sets, the rest defaults."""
    engine = {
        "kv_cache_memory": args.kv_cache_mib << 20,
        "token_budget": args.token_budget,
        "cpu_cores": engine_cores or None,
    }
    return {
        "model": model,
        "model_name": model_name,
        "groups": [{"name": "default", "num_replicas": 1, "engine": engine}],
    }


async def run_chat_sides(
    args: argparse.Namespace,
    url: str,
    model_name: str,
    model: str | None = None,
    session: int | None = None,
) -> None:
    """Meridian's endpoint, the peer's (``--peer-url``) and, with ``--engines`` and the
    ``model`` Meridian serves, its engines alone (``bench/engine_side.py``). ``session``:
    the app's, when this bench started it; it is paused while the other sides run."""
    sides: list[tuple[str, Any]] = [("meridian", ChatClient(url, model_name, args.api_key))]
    if args.peer_url:
        sides.append((args.peer_name, ChatClient(args.peer_url, args.peer_model)))
    if args.engines:
        from bench.engine_side import EngineSide

        sides.append(("engines", EngineSide(model or args.model_path, args.engines)))
    try:
        own = {} if session is None else {"meridian": session}
        await run_chat(args, sides, with_peer(own, args.peer_name, args.peer_url))
    finally:
        for _, client in sides:
            await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", "--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--dataset", choices=("random", "sharegpt", "mtbench"), default="random")
    ap.add_argument(
        "--model-path", help="what Meridian serves (chat): a .gguf, a folder or a packaged name"
    )
    ap.add_argument("--tokenizer", help="for ShareGPT's token counts (default: the model path)")
    ap.add_argument("--num-prompts", type=int, default=64, help="conversations per run (chat)")
    ap.add_argument("--max-output-tokens", type=int, default=128, help="cap per turn (chat)")
    ap.add_argument("--stop-at-eos", action="store_true", help="ShareGPT: no ignore_eos")
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the prompts' sampling, chat datasets and random prompts (default: a fresh one, "
        "printed; a peer server that outlived the last invocation would find a repeated sample "
        "in its prefix cache)",
    )
    ap.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per second (chat)"
    )
    ap.add_argument("--ttft-slo", type=float, default=3000.0, help="ms, for goodput")
    ap.add_argument("--tpot-slo", type=float, default=150.0, help="ms, for goodput")
    ap.add_argument("--kv-cache-mib", type=int, default=None, help="256 random, 1024 chat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--per-stream", type=int, default=3, help="requests per stream and run")
    ap.add_argument("--min-requests", type=int, default=12, help="at least this many per run")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument(
        "--token-budget",
        type=int,
        default=512,
        help="the engine's tokens per step (as serve_config.yaml); 2048: +2-3%% req/s, 2x TTFT",
    )
    ap.add_argument(
        "--engine-cores",
        type=int,
        nargs="*",
        default=[(os.cpu_count() or 1) - 1] if (os.cpu_count() or 1) > 1 else [],
        help="cores for the engine threads (the rest for everything else); none: unpinned",
    )
    ap.add_argument(
        "--via-proxy",
        action="store_true",
        help="drive Serve's proxy, not the ingress replica's own port (direct ingress)",
    )
    ap.add_argument("--base-url", help="only the HTTP side, against this OpenAI-style server")
    ap.add_argument("--model", default=None, help="the model name to send (with --base-url)")
    ap.add_argument("--api-key", default=None, help="a Bearer key (with --base-url)")
    ap.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not send return_token_ids (a server that rejects it; with --base-url)",
    )
    ap.add_argument("--write-model", help="write the bench model into this folder and exit")
    ap.add_argument("--model-dir", help="serve the bench model from this folder")
    ap.add_argument("--peer-url", help="a peer OpenAI server on the same weights, interleaved")
    ap.add_argument("--peer-model", default="bench", help="the model name the peer serves")
    ap.add_argument(
        "--peer-python",
        help="start vLLM's CPU server on --model-dir with this interpreter (its venv's python) "
        "as the peer, instead of --peer-url (the random dataset)",
    )
    ap.add_argument("--peer-name", default="vllm", help="the peer's column (chat datasets)")
    ap.add_argument(
        "--engines",
        type=int,
        default=0,
        help="chat datasets: a side of N in-process engines on the same model, each in its "
        "own process pinned to its own cores (bench/engine_side.py); N as the app's replicas",
    )
    ap.add_argument(
        "--defaults",
        action="store_true",
        help="start the app as `make serve` does, on a config of only model and one group",
    )
    ap.add_argument(
        "--cpu-hog",
        action="store_true",
        help="with --defaults: a side that runs beside a CPU-bound process at nice 0",
    )
    ap.add_argument(
        "--group",
        default="{name: main}",
        help="with --defaults: the config's one group, a YAML mapping (to try another layout)",
    )
    ap.add_argument(
        "--cpu-profile",
        action="store_true",
        help="with --defaults: each run's CPU time by part (engines, ingress, proxy, client...)",
    )
    ap.add_argument(
        "--client-nice",
        type=int,
        default=0,
        help="with --defaults or --base-url (servers in sessions of their own): run the "
        "client in its own session at this priority, e.g. -10 (bench/client_session.py); "
        "0: as started",
    )
    args = ap.parse_args()
    chat = args.dataset != "random"
    if args.kv_cache_mib is None:
        args.kv_cache_mib = 1024 if chat else 256

    if args.write_model:
        print(write_bench_model(Path(args.write_model)))
        return
    if chat:
        if not args.model_path and not args.base_url:
            ap.error(f"--dataset {args.dataset} needs --model-path (or --base-url and --model)")
        if args.dataset == "sharegpt" and not (args.tokenizer or args.model_path):
            ap.error("--dataset sharegpt with --base-url needs --tokenizer")
    elif (args.peer_url or args.peer_python) and not args.model_dir:
        ap.error("--peer-url and --peer-python need --model-dir: the folder the peer serves")
    if args.peer_python and (chat or args.peer_url or args.base_url):
        ap.error("--peer-python: the random dataset, without --peer-url or --base-url")
    if args.cpu_hog and (chat or not args.defaults):
        ap.error("--cpu-hog needs --defaults and the random dataset")
    if args.engines and not (chat and args.defaults):
        ap.error("--engines needs --defaults and a chat dataset (its engines run the defaults)")
    if args.cpu_profile and (chat or not args.defaults):
        ap.error("--cpu-profile needs --defaults and the random dataset")
    if args.defaults or args.base_url:  # else the app runs in this session: nothing to raise
        status = rerun_as_client(args.client_nice)
        if status is not None:
            sys.exit(status)
    peer: contextlib.AbstractContextManager[tuple[str, str] | None] = contextlib.nullcontext()
    if args.peer_python:
        model_dir = Path(args.model_dir)
        if not (model_dir / "config.json").exists():
            write_bench_model(model_dir)
        peer = vllm_server(args.peer_python, str(model_dir), args.peer_model)
    with peer as started:
        if started is not None:
            args.peer_url, args.peer_model = started
        dispatch(args, chat, ap)


def dispatch(args: argparse.Namespace, chat: bool, ap: argparse.ArgumentParser) -> None:
    """The run ``args`` ask for, once they are checked and the peer (if any) answers."""
    if args.defaults:
        main_defaults(args, chat)
        return
    if chat and args.base_url:
        if not args.model:
            ap.error("--base-url needs --model")
        asyncio.run(run_chat_sides(args, args.base_url, args.model))
        return
    if args.base_url:
        if not args.model:
            ap.error("--base-url needs --model")
        asyncio.run(run_http_only(args))
        return

    import torch

    from actors.serving.config import ServeConfig

    threads = str(args.torch_threads)
    torch.set_num_threads(args.torch_threads)
    engine_cores = sorted(set(args.engine_cores))
    if engine_cores:
        # before Ray starts: its processes inherit this mask; the engines move themselves
        others = set(range(os.cpu_count() or 1)) - set(engine_cores)
        if not others:
            ap.error("--engine-cores must leave at least one core for everything else")
        os.sched_setaffinity(0, others)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    env["RAY_CGRAPH_buffer_size_bytes"] = str(1 << 24)
    if chat:
        model_name = Path(args.model_path).stem  # a path's stem, or a packaged model's name
        model = Path(args.model_path)
        model_ref = str(model.resolve()) if model.exists() else args.model_path
        app_args = app_config(args, model_ref, model_name, engine_cores)
        print(
            f"{args.dataset}: Meridian serves {args.model_path}; up to {args.max_output_tokens} "
            f"tokens a turn, greedy; token budget {args.token_budget}; torch threads "
            f"{args.torch_threads}; engine cores {engine_cores or 'unpinned'}; {load()}",
            flush=True,
        )
        with serve_app(app_args, 1, env, direct=not args.via_proxy) as url:
            asyncio.run(run_chat_sides(args, url, model_name))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.model_dir:
            model_dir = Path(args.model_dir)
            if not (model_dir / "config.json").exists():
                write_bench_model(model_dir)
        else:
            model_dir = write_bench_model(Path(tmp) / "bench")
        app_args = app_config(args, str(model_dir), MODEL_NAME, engine_cores)
        cfg = ServeConfig.model_validate(app_args)
        print(
            f"model: {MODEL}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, "
            f"greedy, ignore_eos; token budget {args.token_budget}; torch threads "
            f"{args.torch_threads}; engine cores "
            f"{engine_cores or 'unpinned'}; HTTP via "
            f"{'the Serve proxy' if args.via_proxy else 'direct ingress'}; {load()}",
            flush=True,
        )
        with serve_app(app_args, 1, env, direct=not args.via_proxy) as url:
            inproc = InProcess(model_dir, cfg, args.new_tokens)
            try:
                asyncio.run(run_both(args, url, inproc))
            finally:
                inproc.close()


def main_defaults(args: argparse.Namespace, chat: bool) -> None:
    """``--defaults``: nothing of this bench's own tuning (cores, threads, budget, KV size)
    reaches the server; it runs as ``make serve`` runs it (``bench/serve_defaults.py``)."""
    from bench.serve_defaults import make_serve_env, run_defaults, serve_run
    from bench.serve_profile import CpuProfile

    with tempfile.TemporaryDirectory() as tmp:
        if chat:
            path = Path(args.model_path)
            model = str(path.resolve()) if path.exists() else args.model_path
        elif args.model_dir:
            model = str(Path(args.model_dir).resolve())
            if not (Path(model) / "config.json").exists():
                write_bench_model(Path(model))
        else:
            model = str(write_bench_model(Path(tmp) / "bench"))
        print(
            f"--defaults: `serve run` as `make serve` ({make_serve_env()}) on {{model: "
            f"{model}, groups: [{args.group}]}}; {args.dataset} workload; {load()}",
            flush=True,
        )
        with serve_run(model, args.group) as (url, name, pid):
            if chat:
                asyncio.run(run_chat_sides(args, url, name, model, pid))
            else:
                profile = CpuProfile(pid) if args.cpu_profile else None
                asyncio.run(run_defaults(args, url, name, pid, profile))


if __name__ == "__main__":
    main()
