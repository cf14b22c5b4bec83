"""DualPath, simulated: agentic multi-turn trajectories on prefill engines (PEs) and decode
engines (DEs) whose stored KV is read through per-engine storage links.

Model (each figure an input, none fitted to the paper's results):

- every engine has a storage link of ``storage_bps`` (its share of its node's storage
  NIC; a DE's is ``decode_storage_bps`` when set: skewed storage bandwidth) and a
  compute link of ``compute_bps``; a read is FIFO on its link;
- a request (one turn) has ``hit`` tokens in the store (the whole previous context) and
  ``new`` appended tokens; its hit KV is read on the PE's link (PE path) or on the DE's
  link and then over the DE's compute link to the PE (DE path), ``kv_bytes_per_token``
  each;
- a PE prefills one request at a time, the earliest assigned whose read is done, in
  ``prefill_time(new, hit)`` (``policies.pd_costs.LinearPrefillTime``);
- a DE holds at most ``hbm_tokens`` of KV; a request decodes ``output`` tokens at
  ``tpot = decode_base + decode_per_seq * running`` (running requests when it starts);
- offline: every trajectory's first turn arrives at 0 and each next turn when the last
  one finished (``Turn.pause`` seconds later: a tool's run time); completion time = when
  the last trajectory ends.

Variants: ``basic`` (PE path only; PE and DE by fewest unfinished tokens), ``dual`` (same
choice, read on the side with the shorter read queue in tokens: a naive dual path that
does not know the links' rates), ``dual+sched`` (the paper's scheduler,
``policies.dualpath.schedule``: alpha/beta PE classes, the Z rule, the read path by the
read queues measured in time, the links' rates known).
Storage-link balance: max/avg of the bytes each storage link read.

Online: open loop, trajectory i's first turn arrives at ``starts[i]`` (``poisson_starts``;
``online_capacity``: the highest swept arrival rate whose mean TTFT and mean TPOT stay
within the SLOs, the paper's TTFT <= 4 s, TPOT <= 50 ms; a finite set of long
trajectories never reaches a steady state at high rates, so prefer:) or closed loop,
``concurrency`` trajectories at once (``closed_loop_capacity``: the most at once within
the SLOs, and the turns per second served there).

Not modelled: layer-wise prefill (reads and compute of one request do not overlap), the
intra-engine attention quota, compute-link contention.
Pure Python on the simulator's event loop; deterministic for a seed.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from policies.dualpath import (
    DECODE_PATH,
    PREFILL_PATH,
    EngineLoad,
    WaitingRequest,
    pick_path,
    read_threshold,
    schedule,
    work_threshold,
)
from policies.pd_costs import LinearPrefillTime
from sim.events import Event, EventLoop

VARIANTS = ("basic", "dual", "dual+sched")


@dataclass(frozen=True)
class DualPathConfig:
    num_prefill: int = 2
    num_decode: int = 4
    storage_bps: float = 50e9 / 8  # a 400 Gb/s storage NIC shared by 8 GPUs
    decode_storage_bps: float | None = None  # DEs' storage links (None: storage_bps)
    compute_bps: float = 50e9  # a 400 Gb/s compute NIC per GPU
    kv_bytes_per_token: int = 70_000  # an MLA model (DeepSeek V3: ~70 KB per token)
    prefill: LinearPrefillTime = LinearPrefillTime(0.01, 5e-5, 1e-7, 2e-10)
    decode_base: float = 0.015
    decode_per_seq: float = 0.0002
    hbm_tokens: int = 2_000_000  # KV tokens a DE holds
    prefill_tokens_per_s: float = 20_000.0  # for beta

    @property
    def de_storage_bps(self) -> float:
        return self.storage_bps if self.decode_storage_bps is None else self.decode_storage_bps


@dataclass(frozen=True)
class Turn:
    append: int  # new tokens of this turn
    output: int
    pause: float = 0.0  # seconds from the previous turn's end to this turn's arrival


@dataclass
class Trajectory:
    first: int  # tokens of the first prompt
    turns: list[Turn]


def agentic_trajectories(
    n: int,
    seed: int = 0,
    turns: tuple[int, int] = (60, 157),
    append: tuple[int, int] = (430, 610),
    output: tuple[int, int] = (150, 180),
    first: tuple[int, int] = (1000, 3000),
) -> list[Trajectory]:
    """Trajectories shaped like the paper's traces: 60-157 turns, ~430-610-token appends,
    ~150-180-token outputs (uniform in those ranges; contexts grow to tens of thousands)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(*turns)
        out.append(
            Trajectory(
                rng.randint(*first),
                [Turn(rng.randint(*append), rng.randint(*output)) for _ in range(k)],
            )
        )
    return out


@dataclass
class _Req:
    rid: str
    traj: int
    turn: int
    tokens: int  # prompt
    hit: int
    output: int
    arrival: float
    read_done: float = 0.0
    pe: int = -1
    de: int = -1


@dataclass
class DualPathResult:
    variant: str
    completion_time: float
    storage_bytes: list[float]  # per storage link: PEs then DEs
    decode_path_share: float  # of requests with a hit
    mean_ttft: float
    mean_tpot: float = 0.0

    @property
    def storage_max_over_avg(self) -> float:
        avg = sum(self.storage_bytes) / len(self.storage_bytes)
        return max(self.storage_bytes) / avg if avg else 0.0


@dataclass
class _Engine:
    tok: int = 0  # unfinished tokens
    seq: int = 0  # unfinished requests
    busy: bool = False
    ready: deque[_Req] = field(default_factory=deque)  # PEs: reads done, waiting
    link_free: float = 0.0  # storage link free from
    read_q: int = 0  # tokens waiting to be read on its storage link
    read_bytes: float = 0.0
    running: int = 0  # DEs: decoding now


class DualPathSim:
    def __init__(self, cfg: DualPathConfig, variant: str) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.cfg, self.variant = cfg, variant
        self.pes = [_Engine() for _ in range(cfg.num_prefill)]
        self.des = [_Engine() for _ in range(cfg.num_decode)]
        self.loop = EventLoop()
        self.waiting: deque[_Req] = deque()
        self.alpha = read_threshold(cfg.storage_bps / cfg.kv_bytes_per_token)
        self.beta = work_threshold(cfg.prefill_tokens_per_s)
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.hits = 0
        self.decode_reads = 0
        self.end = 0.0
        self._next_traj = 0

    # -- nodes: PE i is node "p{i}", DE j node "d{j}" --------------------------------------
    def _read_queues(self) -> dict[str, int]:
        q = {f"p{i}": e.read_q for i, e in enumerate(self.pes)}
        return q | {f"d{j}": e.read_q for j, e in enumerate(self.des)}

    def _read_rates(self) -> dict[str, float]:
        """Tokens per second each node's storage link reads (what the scheduler knows)."""
        pe = self.cfg.storage_bps / self.cfg.kv_bytes_per_token
        de = self.cfg.de_storage_bps / self.cfg.kv_bytes_per_token
        return {f"p{i}": pe for i in range(len(self.pes))} | {
            f"d{j}": de for j in range(len(self.des))
        }

    def _assign_all(self, now: float) -> list[Event]:
        events: list[Event] = []
        if self.variant == "dual+sched":
            prefill = [EngineLoad(str(i), f"p{i}", e.seq, e.tok) for i, e in enumerate(self.pes)]
            decode = [
                EngineLoad(str(j), f"d{j}", e.seq, e.tok, self.cfg.hbm_tokens - e.tok)
                for j, e in enumerate(self.des)
            ]
            waiting = [WaitingRequest(r.rid, r.tokens, r.hit) for r in self.waiting]
            out = schedule(
                waiting,
                prefill,
                decode,
                self._read_queues(),
                self.alpha,
                self.beta,
                read_rates=self._read_rates(),
            )
            for a in out.assignments:
                r = self.waiting.popleft()
                assert r.rid == a.request_id
                events += self._start(r, int(a.prefill), int(a.decode), a.path, now)
            return events
        while self.waiting:
            r = self.waiting[0]
            pe = min(range(len(self.pes)), key=lambda i: (self.pes[i].tok, i))
            room = [j for j, e in enumerate(self.des) if self.cfg.hbm_tokens - e.tok >= r.tokens]
            if not room:
                break
            de = min(room, key=lambda j: (self.des[j].tok, j))
            path = PREFILL_PATH
            if self.variant == "dual":
                path = pick_path(f"p{pe}", f"d{de}", self._read_queues())
            self.waiting.popleft()
            events += self._start(r, pe, de, path, now)
        return events

    def _start(self, r: _Req, pe: int, de: int, path: str, now: float) -> list[Event]:
        cfg = self.cfg
        r.pe, r.de = pe, de
        p, d = self.pes[pe], self.des[de]
        p.tok += r.tokens - r.hit
        p.seq += 1
        d.tok += r.tokens + r.output
        d.seq += 1
        if r.hit == 0:
            r.read_done = now
            return [Event(now, partial(self._read_done, r, None))]
        self.hits += 1
        side = p if path == PREFILL_PATH else d
        if path == DECODE_PATH:
            self.decode_reads += 1
        nbytes = r.hit * cfg.kv_bytes_per_token
        start = max(now, side.link_free)
        end = start + nbytes / (cfg.storage_bps if path == PREFILL_PATH else cfg.de_storage_bps)
        if path == DECODE_PATH:  # then DE -> PE over the compute link
            end += nbytes / cfg.compute_bps
        side.link_free = end
        side.read_q += r.hit
        side.read_bytes += nbytes
        return [Event(end, partial(self._read_done, r, side))]

    def _read_done(self, r: _Req, side: _Engine | None, now: float) -> list[Event]:
        if side is not None:
            side.read_q -= r.hit
        self.pes[r.pe].ready.append(r)
        return self._run_pe(r.pe, now) + self._assign_all(now)

    def _run_pe(self, i: int, now: float) -> list[Event]:
        p = self.pes[i]
        if p.busy or not p.ready:
            return []
        r = p.ready.popleft()
        p.busy = True
        end = now + self.cfg.prefill(r.tokens - r.hit, r.hit)
        return [Event(end, partial(self._prefill_done, r))]

    def _prefill_done(self, r: _Req, now: float) -> list[Event]:
        p, d = self.pes[r.pe], self.des[r.de]
        p.busy = False
        p.tok -= r.tokens - r.hit
        p.seq -= 1
        self.ttfts.append(now - r.arrival)
        tpot = self.cfg.decode_base + self.cfg.decode_per_seq * d.running
        d.running += 1
        end = now + r.output * tpot
        self.tpots.append(tpot)
        return (
            [Event(end, partial(self._decode_done, r))]
            + self._run_pe(r.pe, now)
            + self._assign_all(now)
        )

    def _decode_done(self, r: _Req, now: float) -> list[Event]:
        d = self.des[r.de]
        d.running -= 1
        d.tok -= r.tokens + r.output
        d.seq -= 1
        self.end = max(self.end, now)
        traj = self.trajs[r.traj]
        nxt = r.turn + 1
        if nxt < len(traj.turns):
            context = r.tokens + r.output  # all of it is in the store (write-back)
            pause = traj.turns[nxt].pause
            req = _Req(
                f"{r.traj}.{nxt}",
                r.traj,
                nxt,
                context + traj.turns[nxt].append,
                context - 1 if context > 0 else 0,
                traj.turns[nxt].output,
                now + pause,
            )
            if pause > 0:  # a tool or a user at work: the turn arrives later
                return self._assign_all(now) + [Event(now + pause, partial(self._arrive, req))]
            self.waiting.append(req)
        elif self._next_traj < len(self.trajs):  # closed loop: the next trajectory starts
            self.waiting.append(self._first_turn(self._next_traj, now))
            self._next_traj += 1
        return self._assign_all(now)

    def _first_turn(self, i: int, at: float) -> _Req:
        t = self.trajs[i]
        return _Req(f"{i}.0", i, 0, t.first + t.turns[0].append, 0, t.turns[0].output, at)

    def _arrive(self, r: _Req, now: float) -> list[Event]:
        self.waiting.append(r)
        return self._assign_all(now)

    def run(
        self,
        trajs: Sequence[Trajectory],
        starts: Sequence[float] | None = None,
        concurrency: int | None = None,
    ) -> DualPathResult:
        """Offline (every trajectory at 0), online open loop (trajectory i's first turn
        arrives at ``starts[i]``) or online closed loop (``concurrency`` trajectories at
        once: when one ends, the next starts)."""
        self.trajs = list(trajs)
        first = len(self.trajs) if concurrency is None else min(concurrency, len(self.trajs))
        self._next_traj = first
        for i in range(first):
            at = starts[i] if starts is not None else 0.0
            self.loop.push(Event(at, partial(self._arrive, self._first_turn(i, at))))
        self.loop.run()
        if self.waiting:
            raise RuntimeError("requests left waiting: no engine could ever take them")
        storage = [e.read_bytes for e in self.pes] + [e.read_bytes for e in self.des]
        return DualPathResult(
            self.variant,
            self.end,
            storage,
            self.decode_reads / self.hits if self.hits else 0.0,
            sum(self.ttfts) / len(self.ttfts) if self.ttfts else 0.0,
            sum(self.tpots) / len(self.tpots) if self.tpots else 0.0,
        )


def run_variants(cfg: DualPathConfig, trajs: Sequence[Trajectory]) -> dict[str, DualPathResult]:
    return {v: DualPathSim(cfg, v).run(trajs) for v in VARIANTS}


def skewed(cfg: DualPathConfig, prefill_share: float = 0.25) -> DualPathConfig:
    """``cfg`` with skewed storage bandwidth: each PE's storage link reads at
    ``prefill_share`` of a DE's (the prefill nodes' storage NICs shared by more GPUs, or
    busy with other traffic), the DEs' at ``cfg.storage_bps``."""
    if not 0 < prefill_share:
        raise ValueError("prefill_share must be positive")
    return replace(
        cfg, storage_bps=cfg.storage_bps * prefill_share, decode_storage_bps=cfg.storage_bps
    )


def poisson_starts(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times of ``n`` trajectories at ``rate`` per second (Poisson)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def online_capacity(
    cfg: DualPathConfig,
    variant: str,
    trajs: Sequence[Trajectory],
    rates: Sequence[float],
    ttft_slo: float = 4.0,
    tpot_slo: float = 0.05,
    seed: int = 0,
) -> float:
    """The highest of ``rates`` (trajectories per second, ascending) at which mean TTFT and
    mean TPOT stay within their SLOs (0.0: none)."""
    best = 0.0
    for rate in rates:
        r = DualPathSim(cfg, variant).run(trajs, poisson_starts(len(trajs), rate, seed))
        if r.mean_ttft > ttft_slo or r.mean_tpot > tpot_slo:
            break
        best = rate
    return best


def closed_loop_capacity(
    cfg: DualPathConfig,
    variant: str,
    trajs: Sequence[Trajectory],
    max_concurrency: int,
    ttft_slo: float = 4.0,
    tpot_slo: float = 0.05,
) -> tuple[int, float]:
    """The most trajectories running at once (binary search in ``[1, max_concurrency]``,
    assuming SLO misses grow with it) whose mean TTFT and mean TPOT stay within the SLOs,
    and the turns per second served at it; ``(0, 0.0)`` when even one misses."""

    def served(n: int) -> float | None:
        r = DualPathSim(cfg, variant).run(trajs, concurrency=n)
        if r.mean_ttft > ttft_slo or r.mean_tpot > tpot_slo:
            return None
        return sum(len(t.turns) for t in trajs) / r.completion_time

    lo, hi, best = 1, max_concurrency, (0, 0.0)
    while lo <= hi:
        mid = (lo + hi) // 2
        rate = served(mid)
        if rate is None:
            hi = mid - 1
        else:
            best, lo = (mid, rate), mid + 1
    return best
