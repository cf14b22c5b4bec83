"""A prefix trie whose nodes hold the targets that served that prefix (SkyWalker section 3.2).

A path from the root spells a prompt prefix as a sequence of keys (chained block hashes,
one per full block); each node holds the set of targets (replicas, or remote balancers in a
snapshot trie) that a request with that prefix was sent to. ``insert(keys, target)`` records
``target`` at every node along the path (the root included), so:

Invariant (subset): for every node, ``targets(child) <= targets(parent)``.

``longest_match(keys, available)`` walks down while the next node still holds an available
target and returns that depth and the node's available targets. The walk stops at the first
node without one: by the invariant, no deeper node can have one either.

Size is bounded by ``max_entries`` (node, target) pairs. Eviction is oldest-first by last
insertion: every entry keeps its position in one insertion-ordered dict, and an insert
refreshes its path from the leaf up to the root, so a parent's entry is always newer than any
of its children's entries for the same target. Popping the oldest entry therefore never
removes a target from a node while a child still holds it: the subset invariant survives
eviction. A node left with no targets is unlinked (its children are empty by the invariant,
and were unlinked first).

Pure: stdlib only, no clock, deterministic.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence, Set


class _Node:
    __slots__ = ("children", "depth", "key", "parent", "targets")

    def __init__(self, key: Hashable, parent: _Node | None, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.depth = depth
        self.children: dict[Hashable, _Node] = {}
        self.targets: set[str] = set()


class PrefixTrie:
    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.root = _Node(None, None, 0)
        # (node, target) -> None, oldest first: the eviction order.
        self._entries: dict[tuple[_Node, str], None] = {}
        self.evicted = 0  # entries evicted so far

    def __len__(self) -> int:
        """Number of (node, target) entries."""
        return len(self._entries)

    # -- updates ---------------------------------------------------------------------------
    def insert(self, keys: Sequence[Hashable], target: str) -> None:
        """Record that a request with prefix ``keys`` was sent to ``target``."""
        node = self.root
        path = [node]
        for k in keys:
            child = node.children.get(k)
            if child is None:
                child = node.children[k] = _Node(k, node, node.depth + 1)
            node = child
            path.append(node)
        entries = self._entries
        for n in reversed(path):  # leaf first: a parent's entry stays newer than its child's
            n.targets.add(target)
            e = (n, target)
            entries.pop(e, None)
            entries[e] = None
        while len(entries) > self.max_entries:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        node, target = next(iter(self._entries))
        del self._entries[(node, target)]
        node.targets.discard(target)
        self.evicted += 1
        while node.parent is not None and not node.targets:
            del node.parent.children[node.key]
            node = node.parent

    def remove_target(self, target: str) -> None:
        """Forget ``target`` everywhere (a replica or balancer that left)."""
        doomed = [e for e in self._entries if e[1] == target]
        for node, t in sorted(doomed, key=lambda e: -e[0].depth):  # deepest first
            del self._entries[(node, t)]
            node.targets.discard(t)
            if node.parent is not None and not node.targets and not node.children:
                del node.parent.children[node.key]

    # -- queries ---------------------------------------------------------------------------
    def longest_match(self, keys: Sequence[Hashable], available: Set[str]) -> tuple[int, set[str]]:
        """``(depth, targets)``: the deepest node along ``keys`` that holds an available target,
        and its available targets. ``(0, root's available targets)`` when no key matches (the
        root holds every target recorded and not evicted)."""
        node = self.root
        for k in keys:
            child = node.children.get(k)
            if child is None or child.targets.isdisjoint(available):
                break
            node = child
        return node.depth, node.targets & set(available)

    def match_length(self, keys: Sequence[Hashable], target: str) -> int:
        """How many leading keys of ``keys`` have a node holding ``target``."""
        node = self.root
        for k in keys:
            child = node.children.get(k)
            if child is None or target not in child.targets:
                break
            node = child
        return node.depth

    def nodes(self) -> Iterator[_Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def check_invariants(self) -> None:
        """Raise AssertionError if the subset invariant or the entry bookkeeping is broken."""
        count = 0
        for n in self.nodes():
            count += len(n.targets)
            for c in n.children.values():
                assert c.parent is n and c.depth == n.depth + 1
                assert c.targets <= n.targets, f"child {c.key!r} holds {c.targets - n.targets}"
                assert c.targets, "an empty node stayed linked"
            for t in n.targets:
                assert (n, t) in self._entries
        assert count == len(self._entries) <= self.max_entries
