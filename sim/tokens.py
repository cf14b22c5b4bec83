"""Token ids for a trace request, cheap enough for 12k-token prompts by the thousand.

A Mooncake hash id ``h`` stands for one fixed block of ``trace_block_size`` tokens:
``[BASE + h, PAD, PAD, ...]``. Requests sharing leading hash ids therefore share leading
tokens exactly, so the real chained hashing and the block pool's token comparison see real
prefix sharing; distinct ids differ in their first token, so distinct blocks never collide.
The pad token is a small int (CPython shares those objects), so a 12k-token list costs about
100 KB, and a block is built by one list concatenation.
A request without hash ids gets a unique first token, so it shares nothing.
"""

from __future__ import annotations

from sim.workload import TraceRequest

PAD = 0
BASE = 1_000  # hash id h -> first token BASE + h; the live engine maps ids into its vocab


def prompt_tokens(req: TraceRequest, unique_id: int) -> list[int]:
    bs = req.trace_block_size
    if req.hash_ids is None:
        return [BASE + unique_id] + [PAD] * (req.input_len - 1)
    pad = [PAD] * (bs - 1)
    out: list[int] = []
    for h in req.hash_ids:
        out.append(BASE + h)
        out += pad
    del out[req.input_len :]
    if len(out) < req.input_len:  # a trace with fewer ids than blocks: pad the tail
        out += [PAD] * (req.input_len - len(out))
    return out
