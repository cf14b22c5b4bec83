"""Picking one target among the available ones (SkyWalker Algorithm 1, SelectCandidate).

Targets are local replicas or remote balancers; the caller passes only available ones.

- ``TrieChoice`` (SkyWalker): the available target with the longest recorded prefix of the
  request in a ``PrefixTrie``; ties go to the fewest outstanding requests, then the given
  order. ``record`` inserts the request's prefix under the chosen target.
- ``CachedPrefixChoice``: the exact view instead of the trie: each replica's cached block
  hashes as its own events report them (a ``PrefixIndex``'s live sets, or a simulator's);
  the longest cached prefix wins, ties as for the trie;
- ``MeasuredPrefixChoice``: the same, from prefix lengths the caller measured per request
  beforehand (``measured[request_id]``: replica -> cached prefix blocks), e.g. asked of
  the router's ``PrefixIndex`` when the request arrived;
- ``SessionHashChoice`` (SkyWalker-CH): a ring hash over all known targets keyed by the
  session id (else the first block hash, else the request id); walk the ring from the key
  and take the first available target, skipping unavailable ones.

Pure: stdlib only, deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set
from typing import Protocol

from policies.prefix_trie import PrefixTrie
from policies.routing import ConsistentHash, ReplicaView, RouteRequest, cached_prefix_blocks


class TargetChoice(Protocol):
    def choose(
        self,
        block_hashes: Sequence[int],
        session_id: str | None,
        request_id: str,
        candidates: Sequence[str],
        known: Sequence[str],
        outstanding: Mapping[str, int],
    ) -> tuple[str, int] | None:
        """``(target, matched blocks)`` among ``candidates`` (available, in preference
        order), or None when there are none. ``known``: every target, available or not."""
        ...

    def record(self, block_hashes: Sequence[int], target: str) -> None: ...

    def forget(self, target: str) -> None: ...


class TrieChoice:
    def __init__(self, max_entries: int = 100_000) -> None:
        self.trie = PrefixTrie(max_entries)

    def choose(
        self,
        block_hashes: Sequence[int],
        session_id: str | None,
        request_id: str,
        candidates: Sequence[str],
        known: Sequence[str],
        outstanding: Mapping[str, int],
    ) -> tuple[str, int] | None:
        if not candidates:
            return None
        depth, holders = self.trie.longest_match(block_hashes, set(candidates))
        pool = [c for c in candidates if c in holders] if depth > 0 else list(candidates)
        order = {c: k for k, c in enumerate(candidates)}
        best = min(pool, key=lambda c: (outstanding.get(c, 0), order[c]))
        return best, depth

    def record(self, block_hashes: Sequence[int], target: str) -> None:
        self.trie.insert(block_hashes, target)

    def forget(self, target: str) -> None:
        self.trie.remove_target(target)


class CachedPrefixChoice:
    def __init__(self, cached: Mapping[str, Set[int]]) -> None:
        self.cached = cached  # replica id -> its cached block hashes (live, exact)

    def choose(
        self,
        block_hashes: Sequence[int],
        session_id: str | None,
        request_id: str,
        candidates: Sequence[str],
        known: Sequence[str],
        outstanding: Mapping[str, int],
    ) -> tuple[str, int] | None:
        empty: Set[int] = frozenset()
        return _most_blocks(
            candidates,
            lambda c: cached_prefix_blocks(block_hashes, self.cached.get(c, empty)),
            outstanding,
        )

    def record(self, block_hashes: Sequence[int], target: str) -> None:
        """Nothing: the replica's own events will say what it stored."""

    def forget(self, target: str) -> None:
        pass


class MeasuredPrefixChoice:
    def __init__(self) -> None:
        self.measured: dict[str, Mapping[str, int]] = {}  # request id -> replica -> blocks

    def choose(
        self,
        block_hashes: Sequence[int],
        session_id: str | None,
        request_id: str,
        candidates: Sequence[str],
        known: Sequence[str],
        outstanding: Mapping[str, int],
    ) -> tuple[str, int] | None:
        lengths = self.measured.pop(request_id, {})
        return _most_blocks(candidates, lambda c: lengths.get(c, 0), outstanding)

    def record(self, block_hashes: Sequence[int], target: str) -> None:
        """Nothing: the replica's own events will say what it stored."""

    def forget(self, target: str) -> None:
        pass


class SessionHashChoice:
    def __init__(self, virtual_nodes: int = 100) -> None:
        self.ring = ConsistentHash(virtual_nodes)

    def choose(
        self,
        block_hashes: Sequence[int],
        session_id: str | None,
        request_id: str,
        candidates: Sequence[str],
        known: Sequence[str],
        outstanding: Mapping[str, int],
    ) -> tuple[str, int] | None:
        if not candidates:
            return None
        allowed = set(candidates)
        views = [ReplicaView(t) for t in dict.fromkeys([*known, *candidates])]
        route = RouteRequest(request_id, list(block_hashes), 0, session_id)
        for t in self.ring.rank(route, views, 0.0):
            if t in allowed:
                return t, 0
        return None

    def record(self, block_hashes: Sequence[int], target: str) -> None:
        pass

    def forget(self, target: str) -> None:
        pass


def _most_blocks(
    candidates: Sequence[str], blocks: Callable[[str], int], outstanding: Mapping[str, int]
) -> tuple[str, int] | None:
    """``(target, its blocks)``: the candidate with the most matched blocks, then the fewest
    outstanding pushes, then the earliest in preference order; None without candidates."""
    if not candidates:
        return None
    best = min((-blocks(c), outstanding.get(c, 0), k) for k, c in enumerate(candidates))
    return candidates[best[2]], -best[0]
