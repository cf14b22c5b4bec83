"""Agent trajectories built from the repository's conversation trace (Mooncake FAST'25
``conversation_trace.jsonl``), with DualPath's agentic statistics where the trace is silent.

The trace has no session ids, but its ``hash_ids`` chain the turns of one conversation: a
later request whose blocks start with an earlier request's full blocks (all but its last,
partial one; at least two) continues that conversation. ``conversation_chains`` recovers
the chains: 12,031 requests give 8,056 conversations, 2,012 of them of 2 to 43 turns.

A trajectory interleaves the user's turns, taken from one chain, with tool steps:

- user turns (from the trace): the first prompt's length, each later turn's appended
  message (its input minus the previous input and answer, at least 1 token), each answer's
  length, and the gap between the turns' arrivals as the user's pause;
- tool steps (DualPath's traces, arXiv 2602.21548, where the trace lacks them): the
  trajectory has ``turns`` turns in all (60-157 in the paper), spread evenly after each
  user turn; a tool step's append is the tool's output (430-610 tokens), its answer the
  model's next tool call (150-180 tokens), and the pause before it the tool's run time,
  log-normal (median ``tool_pause_median`` s, sigma ``tool_pause_sigma``): the paper gives
  no pause figures, only "seconds to minutes", so these two are this module's assumption.

Every turn's prompt is the whole previous context, the previous answer and its append;
the context grows by append + answer each turn (the paper's contexts reach 17-33k tokens).
``scaled`` shrinks lengths, pauses and turns for a live run on a CPU. Pure and
deterministic for a seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from sim.dualpath import Trajectory, Turn
from sim.workload import TraceRequest

PAPER_TURNS = (60, 157)
PAPER_TOOL_APPEND = (430, 610)
PAPER_TOOL_OUTPUT = (150, 180)


@dataclass(frozen=True)
class AgentTurn:
    append: int  # tokens added to the context before this turn (0 for the first turn)
    output: int  # tokens the model answers
    pause_s: float  # seconds between the previous answer's end and this turn (0 first)
    tool: bool  # the append is a tool's output (else a user message, or the first prompt)


@dataclass(frozen=True)
class AgentTrajectory:
    first: int  # tokens of the first prompt
    turns: tuple[AgentTurn, ...]
    source: str  # the trace request that opened the conversation

    def prompt_lengths(self) -> list[int]:
        """Each turn's prompt: the previous prompt, its answer and this turn's append."""
        out, context = [], self.first
        for i, t in enumerate(self.turns):
            if i:
                context += self.turns[i - 1].output + t.append
            out.append(context)
        return out

    def as_sim(self) -> Trajectory:
        """The simulator's trajectory (``sim.dualpath``): the first prompt, then each
        turn's append (0 for the first), answer and pause."""
        return Trajectory(self.first, [Turn(t.append, t.output, t.pause_s) for t in self.turns])


def conversation_chains(requests: Sequence[TraceRequest]) -> list[list[TraceRequest]]:
    """Conversations in arrival order, each its turns in order. A request continues the
    latest earlier request whose full blocks (at least two) its ``hash_ids`` start with;
    one request continues at most one, and is continued by at most one (the first)."""
    last_of: dict[tuple[int, ...], int] = {}  # a request's full-block prefix -> its index
    chains: list[list[TraceRequest]] = []
    chain_of: dict[int, int] = {}  # request index -> its chain
    continued: set[int] = set()
    for j, r in enumerate(requests):
        h = r.hash_ids or ()
        parent = -1
        for k in range(len(h) - 1, 1, -1):
            i = last_of.get(h[:k], -1)
            if i >= 0 and i not in continued:
                parent = i
                break
        if parent >= 0:
            continued.add(parent)
            chain_of[j] = chain_of[parent]
            chains[chain_of[j]].append(r)
        else:
            chain_of[j] = len(chains)
            chains.append([r])
        if len(h) > 2:
            last_of[h[:-1]] = j
    return chains


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return math.exp(rng.gauss(math.log(median), sigma))


def build_trajectories(
    requests: Sequence[TraceRequest],
    n: int,
    seed: int = 0,
    min_user_turns: int = 2,
    turns: tuple[int, int] = PAPER_TURNS,
    tool_append: tuple[int, int] = PAPER_TOOL_APPEND,
    tool_output: tuple[int, int] = PAPER_TOOL_OUTPUT,
    tool_pause_median: float = 2.0,
    tool_pause_sigma: float = 1.0,
) -> list[AgentTrajectory]:
    """``n`` trajectories over conversations of at least ``min_user_turns`` turns drawn
    from the trace (with replacement when there are fewer than ``n``)."""
    chains = [c for c in conversation_chains(requests) if len(c) >= min_user_turns]
    if not chains:
        raise ValueError(f"the trace has no conversation of {min_user_turns}+ turns")
    rng = random.Random(seed)
    picked = rng.sample(chains, n) if n <= len(chains) else rng.choices(chains, k=n)
    out = []
    for chain in picked:
        total = max(rng.randint(*turns), len(chain))
        tools = total - len(chain)
        # tool steps after user turn u: an even split, the remainder to the earliest turns
        per_user = [tools // len(chain) + (u < tools % len(chain)) for u in range(len(chain))]
        steps: list[AgentTurn] = []
        for u, r in enumerate(chain):
            if u == 0:
                steps.append(AgentTurn(0, r.output_len, 0.0, False))
            else:
                prev = chain[u - 1]
                append = max(1, r.input_len - prev.input_len - prev.output_len)
                pause = max(0.0, r.arrival - prev.arrival)
                steps.append(AgentTurn(append, r.output_len, pause, False))
            for _ in range(per_user[u]):
                pause = _lognormal(rng, tool_pause_median, tool_pause_sigma)
                steps.append(
                    AgentTurn(rng.randint(*tool_append), rng.randint(*tool_output), pause, True)
                )
        out.append(AgentTrajectory(chain[0].input_len, tuple(steps), chain[0].request_id))
    return out


def scaled(
    trajs: Sequence[AgentTrajectory],
    length: float = 1.0,
    pause: float = 1.0,
    max_turns: int | None = None,
    max_output: int | None = None,
    max_pause_s: float | None = None,
    max_first: int | None = None,
) -> list[AgentTrajectory]:
    """Lengths times ``length`` (at least 1 token; the first append stays 0), pauses times
    ``pause`` (capped at ``max_pause_s``), first prompts capped at ``max_first`` and
    outputs at ``max_output`` tokens, the first ``max_turns`` turns."""

    def tokens(x: int) -> int:
        return max(1, round(x * length))

    out = []
    for t in trajs:
        turns = []
        for i, s in enumerate(t.turns[:max_turns]):
            out_tokens = tokens(s.output)
            if max_output is not None:
                out_tokens = min(out_tokens, max_output)
            p = s.pause_s * pause
            if max_pause_s is not None:
                p = min(p, max_pause_s)
            turns.append(AgentTurn(tokens(s.append) if i else 0, out_tokens, p, s.tool))
        first = tokens(t.first) if max_first is None else min(tokens(t.first), max_first)
        out.append(AgentTrajectory(first, tuple(turns), t.source))
    return out


def summary(trajs: Sequence[AgentTrajectory]) -> dict[str, float]:
    """Turns, final context, mean append and output, tool share and median tool pause."""
    turns = [t for tr in trajs for t in tr.turns]
    later = [t for tr in trajs for t in tr.turns[1:]]
    pauses = sorted(t.pause_s for t in later if t.tool)
    finals = [tr.prompt_lengths()[-1] + tr.turns[-1].output for tr in trajs]
    return {
        "trajectories": len(trajs),
        "turns": len(turns),
        "mean_turns": len(turns) / len(trajs),
        "mean_first": sum(t.first for t in trajs) / len(trajs),
        "mean_final_context": sum(finals) / len(finals),
        "mean_append": sum(t.append for t in later) / max(1, len(later)),
        "mean_output": sum(t.output for t in turns) / len(turns),
        "tool_share": sum(t.tool for t in later) / max(1, len(later)),
        "median_tool_pause_s": pauses[len(pauses) // 2] if pauses else 0.0,
    }
