"""Sides measured in turns, so every side sees the same machine: repeat r runs the sides
in order, the one that goes first rotating with r (A, B; B, A; ... or A, B, C; B, C, A;
...), and a figure is reported as the median over repeats. The one interleaving every
bench that compares sides uses."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TypeVar

S = TypeVar("S")
R = TypeVar("R")


def turns(sides: Sequence[S], repeat: int, rotate: bool = True) -> list[S]:
    """The order of ``sides`` in repeat ``repeat``: rotated by ``repeat`` places, or as
    given every time without ``rotate`` (A, B, A, B, ...)."""
    k = repeat % len(sides) if rotate and sides else 0
    return [*sides[k:], *sides[:k]]


def schedule(
    sides: Sequence[S], repeats: int, rotate: bool = True, warmup: int = 0
) -> Iterator[tuple[int, S]]:
    """(repeat, side) in the order they run: ``warmup`` uncounted rounds first (repeats
    -warmup .. -1), then repeats 0 .. ``repeats`` - 1, each in ``turns``. For a bench whose
    run is a coroutine; ``interleaved`` is the same order for a plain call."""
    for rep in range(-warmup, repeats):
        for side in turns(sides, rep, rotate):
            yield rep, side


def interleaved(
    sides: Sequence[S],
    repeats: int,
    run: Callable[[S, int], R],
    rotate: bool = True,
    warmup: int = 0,
) -> dict[S, list[R]]:
    """``run(side, repeat)`` for every side in ``schedule``'s order; each side's results
    in repeat order, the warm-up rounds' (negative repeats) left out."""
    results: dict[S, list[R]] = {s: [] for s in sides}
    for rep, side in schedule(sides, repeats, rotate, warmup):
        result = run(side, rep)
        if rep >= 0:
            results[side].append(result)
    return results


def seconds_in_turns(
    calls: Mapping[S, Callable[[], object]], repeats: int, rotate: bool = False
) -> dict[S, list[float]]:
    """Wall seconds of each call, ``repeats`` times in ``turns`` (A, B, A, B, ... unless
    ``rotate``)."""

    def timed(side: S, _repeat: int) -> float:
        start = time.perf_counter()
        calls[side]()
        return time.perf_counter() - start

    return interleaved(list(calls), repeats, timed, rotate)


def medians(
    rows: Sequence[Mapping[str, float]], keys: Iterable[str] | None = None
) -> dict[str, float]:
    """Each key's median over ``rows`` (``keys``, or the first row's; NaN where a row lacks
    it)."""
    return {
        k: statistics.median(r.get(k, float("nan")) for r in rows)
        for k in (rows[0] if keys is None else keys)
    }


def median_ratio(a: Iterable[float], b: Iterable[float]) -> float:
    """The median over repeats of a / b, the two sides' figures paired by repeat: a zero
    b against a positive a counts as inf, a pair of zeros is left out (NaN when every pair
    is)."""
    ratios = [x / y if y else float("inf") for x, y in zip(a, b, strict=True) if x or y]
    return statistics.median(ratios) if ratios else float("nan")


def invocation_seed(seed: int | None, what: str) -> int:
    """``seed``, or a fresh one when None, printed with ``what`` it draws. A server that
    outlives one invocation (a peer started once) would otherwise find the last invocation's
    prompts in its prefix cache, where a server started by the bench finds none."""
    if seed is None:
        seed = random.SystemRandom().randrange(2**31)
    print(f"{what}: drawn with seed {seed} (--seed {seed} draws them again)", flush=True)
    return seed
