"""A synthetic workload: Poisson arrivals, log-normal lengths, multi-turn sessions.

A session's turn k sends the whole conversation so far (its previous prompts and answers)
plus a new user message, so its prefix grows turn by turn and shares the previous turn's
blocks: the hash ids of turn k start with every full block id of turn k-1's prompt+answer.
Deterministic for a given seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sim.workload import TraceRequest


@dataclass
class SyntheticSpec:
    rate: float = 1.0  # sessions started per second (Poisson)
    num_sessions: int = 100
    turns_mean: float = 3.0  # turns per session, geometric with this mean
    system_prompt_tokens: int = 1024  # shared by every session
    input_median: int = 800  # new user tokens per turn (log-normal)
    output_median: int = 200
    sigma: float = 0.8  # log-normal shape of both lengths
    think_time: float = 20.0  # mean seconds between a session's turns (exponential)
    block_size: int = 512
    max_input: int = 128_000
    seed: int = 0


def generate(spec: SyntheticSpec) -> list[TraceRequest]:
    rng = random.Random(spec.seed)
    bs = spec.block_size
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system_ids = fresh(spec.system_prompt_tokens // bs)
    out: list[TraceRequest] = []
    t = 0.0
    for s in range(spec.num_sessions):
        t += rng.expovariate(spec.rate)
        turns = (
            1 + int(math.log(1 - rng.random()) / math.log(1 - 1 / spec.turns_mean))
            if spec.turns_mean > 1
            else 1
        )
        context_ids = list(system_ids)  # full blocks of the conversation so far
        context_len = len(system_ids) * bs
        arrival = t
        for k in range(turns):
            new_in = max(1, int(rng.lognormvariate(math.log(spec.input_median), spec.sigma)))
            out_len = max(1, int(rng.lognormvariate(math.log(spec.output_median), spec.sigma)))
            input_len = min(context_len + new_in, spec.max_input)
            n_blocks = -(-input_len // bs)
            ids = context_ids[:n_blocks] + fresh(max(0, n_blocks - len(context_ids)))
            out.append(
                TraceRequest(f"s{s}t{k}", arrival, input_len, out_len, tuple(ids), f"s{s}", bs)
            )
            # The next turn re-sends this prompt and its answer: their full blocks are shared.
            full = (input_len + out_len) // bs
            context_ids = ids[: input_len // bs] + fresh(max(0, full - input_len // bs))
            context_len = input_len + out_len
            arrival += rng.expovariate(1 / spec.think_time)
    out.sort(key=lambda r: r.arrival)
    return out
