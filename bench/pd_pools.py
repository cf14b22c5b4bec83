"""One cluster, not islands: a later turn of a conversation reuses its earlier turns' KV
even when it lands on another prefill replica, measured through the OpenAI chat API.

A Ray cluster of two raylets on this machine (``ray.cluster_utils.Cluster``: a head node
and one more node, ``--head-cpus`` / ``--node-cpus`` each, token auth off on this private
127.0.0.1 cluster) runs two Serve applications of ``serve_app.build_app``, deployed side by
side for the whole run (application names ``islands`` and ``shared``, route prefixes
``/islands`` and ``/shared``, one Serve proxy on the head node), each one disaggregated
group with the same engine section and a ``store`` section with ``write_back`` (decode
replicas write the answers' blocks to the store too) and ``--store-mib`` of DRAM per shard:

- *islands*: ``num_replicas: 2, num_prefill: 1, num_decode: 1``: two Serve replicas, each
  owning a private cluster (its prefill and decode replica, its store shards, its
  Conductor), app routing ``round_robin``, so the turns of one conversation go to
  islands whose caches do not share. The router's counter is one for all requests: with
  one conversation in flight (``--concurrency 1``) its turns alternate strictly, with
  several a later turn lands on the other island about half the time ("missed" below);
- *shared*: ``num_replicas: 1, num_prefill: 2, num_decode: 1``: one cluster, one Conductor
  over both prefill replicas (one per node) and one store with a shard per node.

Workload: multi-turn chats, greedy, streamed with ``stream_options.include_usage``:
MT-bench's two turns (``bench/serve_chat.py``) and ShareGPT conversations' first
``--sharegpt-turns`` (>= 3) user turns (``bench/real_prompts.py: dialogues``, each turn
under ``--max-chars``, together at least ``--min-chars``), alternating,
``--conversations`` per repeat, ``--concurrency`` in flight (closed loop). Each turn is
sent once the previous answer ended, with the whole history: the earlier questions and the
model's own streamed answers; up to ``--max-tokens`` tokens a turn, stopping at EOS. Sides
run interleaved (islands, shared, islands, ...), ``--repeats`` times; every repeat sends
conversations that neither application has seen (the same ones to both sides), so first
turns find only the chat template's system prompt cached. A warm-up of short one-turn
chats precedes the runs on each side.

Per side and repeat, over later turns (turn 2 and on): the cached fraction of their prompt
tokens (``usage.prompt_tokens_details.cached_tokens`` / ``prompt_tokens``, summed), the
ideal fraction (each later turn could skip the previous turn's prompt plus its answer, the
token counts the server reported for that turn, at most its own prompt), their ratio, how
many later turns got under half of their ideal ("missed": the prefix was not found where
the turn ran), later-turn TTFT p50 / p99 and first-turn TTFT p50; medians over repeats.
The ideal counts tokens; the store and the prefix caches hold whole blocks (16 tokens) and
a prompt's last token is always computed, so slightly less is attainable (0.96-0.98 of
it in the runs here). The load average is printed at each run's start and end.

Cost here: the defaults take about 5 minutes to start both applications (seven replicas
load SmolLM2) and 1.5-3 minutes a run on a quiet 2-core machine. With NIXL installed,
every store shard and every decode replica fed across nodes runs a NIXL progress thread
(``store/transfer/nixl_backend.py``), about 0.2 of a core each while idle here: the six
shards of the two applications and their decode replicas, a background load both sides
run beside.

    python bench/pd_pools.py [--model SmolLM2-135M-Instruct] [--repeats 3]
    python bench/pd_pools.py --model tiny --conversations 4 --repeats 1   # a quick check

Last line: ``pd-pools later-turn ttft-p50 islands/shared: <ratio>`` (ratio of the sides'
medians; target >= 1.5 with shared's cached/ideal >= 0.9, printed beside, not asserted).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.interleave import medians, schedule
from bench.pd_apps import model_name, running_apps, samples
from bench.serve_chat import ChatClient, load, mtbench_conversations
from sim.metrics import percentile

SIDES = ("islands", "shared")
COLOCATED_SIDES = ("nostore", "store")  # --colocated: two colocated replicas, without / with


def sides(args: argparse.Namespace) -> tuple[str, str]:
    """(the side without the shared KV, the side with it)."""
    return COLOCATED_SIDES if args.colocated else SIDES


SMOLLM2 = "SmolLM2-135M-Instruct"


# -- the applications ---------------------------------------------------------------------------
def app_args(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """``ServeConfig`` fields of one side: one disaggregated group, the same engine and
    store sections on both sides; with ``--colocated`` one colocated group of two
    replicas, with the store or without."""
    engine = {"kv_cache_memory": args.kv_mib << 20, "token_budget": args.token_budget}
    group: dict[str, Any]
    if side in COLOCATED_SIDES:
        group = {"name": "main", "num_replicas": 2, "engine": engine}
        if side == "store":
            group["store"] = {"dram_bytes": args.store_mib << 20}
    else:
        shape = (2, 1, 1) if side == "islands" else (1, 2, 1)  # replicas, prefill, decode
        group = {
            "name": "pd",
            "num_replicas": shape[0],
            "num_prefill": shape[1],
            "num_decode": shape[2],
            "engine": engine,
            "store": {"dram_bytes": args.store_mib << 20, "write_back": True},
        }
    if args.placement is not None and "store" in group:
        group["store"]["placement"] = args.placement
    model = None if args.model == "tiny" else args.model
    out: dict[str, Any] = {"model": model, "groups": [group], "routing": "round_robin"}
    if model is not None:
        out["model_name"] = model_name(args)
    return out


# -- the workload -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chat:
    turns: tuple[str, ...]
    source: str  # mtbench | sharegpt


@dataclass
class Turn:
    """One turn as the client saw it and the server counted it."""

    chat: int
    source: str  # mtbench | sharegpt
    turn: int  # 1, 2, ...
    ttft: float  # seconds
    prompt: int
    completion: int
    cached: int


def workload(args: argparse.Namespace) -> list[list[Chat]]:
    """``--repeats`` disjoint lists of ``--conversations`` chats, MT-bench and ShareGPT
    alternating. ShareGPT chats are those whose user turns hold ``--min-chars`` or more in
    all (most ShareGPT turns are a line or two: a later turn's history would be mostly the
    model's answers)."""
    from bench.real_prompts import dialogues

    n = args.conversations
    n_mt, n_sg = (n + 1) // 2, n // 2
    mt = mtbench_conversations(args.seed, args.max_tokens)
    if n_mt * args.repeats > len(mt):
        raise SystemExit(f"MT-bench has {len(mt)} questions, not {n_mt * args.repeats}")
    need = n_sg * args.repeats
    pool = dialogues(args.sharegpt_turns, max(200, 20 * need), args.seed, args.max_chars)
    sg = [d for d in pool if sum(map(len, d)) >= args.min_chars]
    if len(sg) < need:
        raise SystemExit(f"ShareGPT gave {len(sg)} chats of >= {args.min_chars} chars, not {need}")
    out = []
    for r in range(args.repeats):
        mts = [Chat(c.turns, "mtbench") for c in mt[r * n_mt : (r + 1) * n_mt]]
        sgs = [Chat(tuple(t), "sharegpt") for t in sg[r * n_sg : (r + 1) * n_sg]]
        chats = [c for pair in zip(mts, sgs, strict=False) for c in pair]
        out.append(chats + mts[len(sgs) :])
    return out


class Client:
    """Streamed, greedy chat turns of one side through the ``openai`` client."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.chat = ChatClient(url, model)
        self.max_tokens = max_tokens
        self.failed: list[str] = []

    async def turn(
        self, messages: list[dict[str, str]], chat: Chat, index: int, turn: int
    ) -> tuple[Turn, str]:
        sample, answer = await self.chat.turn(messages, self.max_tokens, False, turn)
        if sample.cached_tokens is None:
            raise RuntimeError("the server's usage has no prompt_tokens_details.cached_tokens")
        record = Turn(
            index,
            chat.source,
            turn,
            sample.ttft,
            sample.prompt_tokens,
            sample.output_tokens,
            sample.cached_tokens,
        )
        return record, answer

    async def conversation(self, chat: Chat, index: int) -> list[Turn]:
        messages: list[dict[str, str]] = []
        out: list[Turn] = []
        for k, text in enumerate(chat.turns, start=1):
            messages.append({"role": "user", "content": text})
            try:
                record, answer = await self.turn(messages, chat, index, k)
            except Exception as e:  # a 429 or a failed stream: the rest of this chat is lost
                self.failed.append(f"chat {index} turn {k}: {type(e).__name__}: {e}")
                break
            messages.append({"role": "assistant", "content": answer})
            out.append(record)
        return out

    async def close(self) -> None:
        await self.chat.close()


async def drive(client: Client, chats: list[Chat], concurrency: int) -> list[Turn]:
    """Every chat, at most ``concurrency`` at a time (closed loop)."""
    todo = iter(enumerate(chats))
    turns: list[Turn] = []

    async def worker() -> None:
        for i, chat in todo:  # one shared iterator: each chat goes to one worker
            turns.extend(await client.conversation(chat, i))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return turns


# -- what a run measured ------------------------------------------------------------------------
@dataclass
class Run:
    side: str
    repeat: int
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    load_start: str = ""
    load_end: str = ""
    failed: int = 0

    def later(self) -> list[tuple[Turn, int]]:
        """Each later turn with its ideal cached tokens: the previous turn's prompt and
        answer (as the server counted them), at most its own prompt."""
        prev = {(t.chat, t.turn): t for t in self.turns}
        out = []
        for t in self.turns:
            p = prev.get((t.chat, t.turn - 1))
            if t.turn > 1 and p is not None:
                out.append((t, min(t.prompt, p.prompt + p.completion)))
        return out

    def metrics(self) -> dict[str, float]:
        later = self.later()
        prompt = sum(t.prompt for t, _ in later)
        cached = sum(t.cached for t, _ in later) / prompt if prompt else float("nan")
        ideal = sum(i for _, i in later) / prompt if prompt else float("nan")
        first = [t.ttft * 1e3 for t in self.turns if t.turn == 1]
        lat = [t.ttft * 1e3 for t, _ in later]
        return {
            "chats": len({t.chat for t in self.turns}),
            "later": len(later),
            "cached": cached,
            "ideal": ideal,
            "ratio": cached / ideal if ideal else float("nan"),
            "missed": sum(t.cached < 0.5 * i for t, i in later),
            "p50": statistics.median(lat) if lat else float("nan"),
            "p99": percentile(lat, 99),
            "first": statistics.median(first) if first else float("nan"),
            "seconds": self.seconds,
        }


COLUMNS = (  # key, header, width, format
    ("chats", "chats", 5, "{:.0f}"),
    ("later", "later", 5, "{:.0f}"),
    ("cached", "cached", 7, "{:.1%}"),
    ("ideal", "ideal", 7, "{:.1%}"),
    ("ratio", "c/ideal", 7, "{:.2f}"),
    ("missed", "missed", 6, "{:.0f}"),
    ("p50", "later p50", 9, "{:.0f}"),
    ("p99", "later p99", 9, "{:.0f}"),
    ("first", "1st p50", 8, "{:.0f}"),
    ("seconds", "secs", 6, "{:.1f}"),
)


def row(label: str, m: dict[str, float], tail: str = "") -> str:
    cells = " ".join(f"{fmt.format(m[k]):>{w}}" for k, _, w, fmt in COLUMNS)
    return f"{label:<14} {cells}{tail}"


def print_turns(run: Run) -> None:
    """``--verbose``: every turn of a run, in the order the chats were sent."""
    ideal = {(t.chat, t.turn): i for t, i in run.later()}
    for t in sorted(run.turns, key=lambda t: (t.chat, t.turn)):
        i = ideal.get((t.chat, t.turn))
        print(
            f"    chat {t.chat:2d} {t.source:>8} turn {t.turn}: prompt {t.prompt:5d}, cached "
            f"{t.cached:5d}{f' of ideal {i:5d}' if i is not None else ''}, answer "
            f"{t.completion:4d}, ttft {t.ttft * 1e3:6.0f} ms"
        )


def transfer_links(url: str) -> str:
    """Which backend carried KV on each path, from the app's ``/metrics`` (replica-peer
    pairs summed over its Serve replicas)."""
    counts: dict[tuple[str, str], float] = {}
    text = httpx.get(url + "/metrics", timeout=30).text
    for labels, n in samples(text, "meridian:pd_kv_transfer_links"):
        key = (labels["path"], labels["backend"])
        counts[key] = counts.get(key, 0.0) + n
    return ", ".join(f"{p} over {b}: {n:.0f}" for (p, b), n in sorted(counts.items())) or "none"


def report(runs: list[Run], args: argparse.Namespace, links: dict[str, str]) -> None:
    print()
    head = " ".join(f"{h:>{w}}" for _, h, w, _ in COLUMNS)
    print(f"{'side rep':<14} {head}   (TTFT in ms; cached, ideal: of later turns' prompts)")
    for r in runs:
        tail = f"   {r.load_start} -> {r.load_end}" + (f"; {r.failed} failed" if r.failed else "")
        print(row(f"{r.side} {r.repeat + 1}", r.metrics(), tail))
    med: dict[str, dict[str, float]] = {}
    apart, pooled = sides(args)
    for side in (apart, pooled):
        print(f"{side} KV transfers (replica-peer pairs): {links[side]}")
    for side in (apart, pooled):
        ms = [r.metrics() for r in runs if r.side == side]
        med[side] = medians(ms)
        print(row(f"{side} median", med[side]))
    isl, sh = med[apart], med[pooled]
    ratio = isl["p50"] / sh["p50"]
    if args.colocated:
        print(
            f"cached/ideal: store {sh['ratio']:.2f}, nostore {isl['ratio']:.2f}; "
            f"pd-pools colocated later-turn ttft-p50 nostore/store: {ratio:.2f}"
        )
        return
    verdict = "met" if ratio >= 1.5 and sh["ratio"] >= 0.9 else "not met"
    print(
        f"target: islands/shared >= 1.5 with shared cached/ideal >= 0.9: {verdict} "
        f"(shared cached/ideal {sh['ratio']:.2f}, islands {isl['ratio']:.2f})"
    )
    print(f"pd-pools later-turn ttft-p50 islands/shared: {ratio:.2f}")


# -- main ---------------------------------------------------------------------------------------
async def run_all(args: argparse.Namespace, urls: dict[str, str]) -> list[Run]:
    names = sides(args)
    clients = {s: Client(urls[s], model_name(args), args.max_tokens) for s in names}
    try:
        hello = [Chat((f"Say hello to {name}.",), "warmup") for name in ("Ann", "Bo", "Cy", "Di")]
        for side in names:  # loads every replica's kernels; caches only the system prompt
            await drive(clients[side], hello, 2)
            clients[side].failed.clear()
        runs = []
        chats = workload(args)
        for rep, side in schedule(names, args.repeats, rotate=False):  # A, B, A, B, ...
            run = Run(side, rep, load_start=load())
            t0 = time.perf_counter()
            run.turns = await drive(clients[side], chats[rep], args.concurrency)
            run.seconds = time.perf_counter() - t0
            run.load_end = load()
            run.failed = len(clients[side].failed)
            for line in clients[side].failed:
                print(f"  {side} {rep + 1}: {line}")
            clients[side].failed.clear()
            runs.append(run)
            if args.verbose:
                print_turns(run)
            m = run.metrics()
            print(
                f"[rep {rep + 1}] {side:>7}: {m['later']:.0f} later turns, cached "
                f"{m['cached']:.1%} of ideal {m['ideal']:.1%}, later TTFT p50 "
                f"{m['p50']:.0f} ms, {m['seconds']:.1f} s ({run.load_start} -> "
                f"{run.load_end})",
                flush=True,
            )
        return runs
    finally:
        for c in clients.values():
            await c.close()


def main(argv: list[str] | None = None) -> None:
    from bench import pd_pools_scale  # its own module (the --scale mode)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SMOLLM2, help="a .gguf, folder, packaged name, or tiny")
    ap.add_argument("--conversations", type=int, default=4, help="per side and repeat")
    ap.add_argument("--concurrency", type=int, default=2, help="conversations in flight")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96, help="per turn (stops at EOS)")
    ap.add_argument("--sharegpt-turns", type=int, default=3, help="user turns per ShareGPT chat")
    ap.add_argument("--max-chars", type=int, default=2000, help="longest ShareGPT user turn")
    ap.add_argument(
        "--min-chars", type=int, default=1500, help="fewest characters of a ShareGPT chat's turns"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-mib", type=int, default=256, help="KV per prefill/decode replica")
    ap.add_argument("--store-mib", type=int, default=512, help="DRAM per store shard")
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--torch-threads", type=int, default=1, help="per replica (OMP threads)")
    ap.add_argument("--head-cpus", type=int, default=2, help="Ray CPUs of the head node")
    ap.add_argument("--node-cpus", type=int, default=2, help="Ray CPUs of the second node")
    ap.add_argument(
        "--placement",
        choices=("key", "local"),
        help="the store's placement on both sides (default: the config's default)",
    )
    ap.add_argument("--verbose", action="store_true", help="print every turn of every run")
    ap.add_argument("--scale", action="store_true", help="the pool-scaling step instead")
    ap.add_argument(
        "--colocated",
        action="store_true",
        help="two colocated replicas without / with the shared store, instead",
    )
    pd_pools_scale.add_options(ap)
    args = ap.parse_args(argv)
    if args.scale:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        pd_pools_scale.main(args)
        return
    if args.sharegpt_turns < 3:
        ap.error("--sharegpt-turns must be at least 3")
    chats = workload(args)  # fails early when the datasets cannot give enough
    what = (
        "2 colocated replicas (round_robin) without vs with the store"
        if args.colocated
        else "islands (2 x 1P+1D, round_robin) vs shared (1 x 2P+1D); store write_back"
    )
    print(
        f"pd-pools: {args.model}; 2 raylets; {what}, {args.store_mib} MiB/shard, placement "
        f"{args.placement or 'default'}; "
        f"{len(chats[0])} chats per repeat (MT-bench 2 turns, ShareGPT "
        f"{args.sharegpt_turns}), {args.concurrency} in flight, up to {args.max_tokens} "
        f"tokens a turn, greedy; {args.repeats} repeats; {load()}",
        flush=True,
    )
    # SIGTERM unwinds (SystemExit), so the Ray cluster this started is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    with running_apps({side: app_args(side, args) for side in sides(args)}, args) as urls:
        up = time.monotonic() - t0
        print(f"both applications healthy after {up:.0f} s; {load()}", flush=True)
        runs = asyncio.run(run_all(args, urls))
        links = {side: transfer_links(url) for side, url in urls.items()}
    report(runs, args, links)


if __name__ == "__main__":
    main()
