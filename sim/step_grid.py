"""A grid of step shapes, timed on an otherwise idle live engine, for ``sim.sim_to_real``'s fit.

A trace's own steps cover step shapes unevenly (a light trace is nearly all one-decode
steps; a heavy one nearly all full-budget chunks), so a model fitted to one trace's steps
does not carry to another. The grid runs every kind of step the replays produce, a few of
each, independent of any trace:

- prefill chunks of ``CHUNKS`` tokens after ``OFFSETS`` cached tokens (a prefix run once
  first, then hit in the prefix cache by each chunk's prompt);
- decode batches of ``DECODE_BATCHES`` requests at ``DECODE_CONTEXTS`` tokens of context
  (their prompts' prefill steps, several prompts packed per step, come with them);
- mixed steps: a chunk of ``MIXED_CHUNKS`` tokens (at offset 0 and, for the long prompt,
  at growing offsets) riding with ``MIXED_DECODES`` running decodes.

The engine is driven through two callables so this module needs neither torch nor the
engine: ``submit(prompt, max_tokens, request_id)`` queues a request, ``step()`` runs one
iteration and returns its batch (``(new tokens, context)`` per request; empty when idle).
"""

from __future__ import annotations

from collections.abc import Callable

OFFSETS = (128, 384, 768)
CHUNKS = (1, 8, 32, 64, 128, 192, 256)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (16, 256, 640)
MIXED_DECODES = (1, 4, 16, 32)
MIXED_CHUNKS = (16, 64, 256, 700)  # 700: several chunks at growing offsets
DECODE_STEPS = 3  # decode steps per decode batch (max_tokens - 1)

Submit = Callable[[list[int], int, str], None]
Step = Callable[[], list[tuple[int, int]]]


class _Prompts:
    """Prompts that share no cached prefix with each other: each starts with its own pair
    of tokens (a block hash chain differs from its first block on)."""

    def __init__(self, vocab: int, base: int) -> None:
        self.vocab, self.k = vocab, base

    def fresh(self, n: int) -> list[int]:
        self.k += 1
        head = [1 + self.k % (self.vocab - 1), 1 + (self.k // (self.vocab - 1)) % (self.vocab - 1)]
        body = [1 + (self.k * 7 + i) % (self.vocab - 1) for i in range(max(0, n - 2))]
        return (head + body)[:n]


def run_step_grid(submit: Submit, step: Step, tag: str, vocab: int) -> list[str]:
    """Run the grid (see the module doc); returns the request ids it submitted, for the
    caller to release. The caller times ``step`` (it wraps the engine's)."""
    prompts = _Prompts(vocab, base=4_000_000)
    ids: list[str] = []

    def add(prompt: list[int], max_tokens: int) -> None:
        rid = f"{tag}-{len(ids)}"
        ids.append(rid)
        submit(prompt, max_tokens, rid)

    def drain() -> None:
        while step():
            pass

    # Prefill chunks at cached offsets: the prefix runs once, then each chunk's prompt
    # (prefix + fresh tokens) hits it in the prefix cache and computes only the chunk.
    for offset in OFFSETS:
        prefix = prompts.fresh(offset)
        add(prefix, 1)
        drain()
        for n in CHUNKS:
            add(prefix + prompts.fresh(n), 1)
            drain()
    # Decode batches (and the packed prefill steps of their prompts).
    for ctx in DECODE_CONTEXTS:
        for b in DECODE_BATCHES:
            for _ in range(b):
                add(prompts.fresh(ctx), DECODE_STEPS + 1)
            drain()
    # Mixed steps: b running decodes, then a prompt arrives and rides with them.
    for b in MIXED_DECODES:
        for n in MIXED_CHUNKS:
            for _ in range(b):
                add(prompts.fresh(128), 16)
            while any(q > 1 for q, _ in step()):  # until every one of them decodes
                pass
            add(prompts.fresh(n), 1)
            drain()
    return ids
