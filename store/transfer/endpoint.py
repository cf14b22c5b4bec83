"""What one end of a KV transfer publishes, and the copy operations between two ends.

An ``Endpoint`` is a small picklable descriptor: it travels on the control path (a Ray call,
a compiled-graph plan); the KV bytes never do. It names the endpoint's node, its shared
memory segment (readable and writable by processes on the same node) and, when it serves
one, the TCP address and token through which processes on other nodes reach the segment.

A transfer is one-sided, as in Mooncake's transfer engine: the side that moves the bytes
names byte ranges of the *remote* segment, each paired with bytes of its own memory. Two
ways to name the local bytes:

    ranges: (LocalMemory, Sequence[tuple[int, int, int]])   # the runtime's KV moves
        local memory registered once (a KV pool, a paged cache's K and V tensors) and
        (remote offset, local offset, nbytes) integer triples: checking and merging them
        is integer arithmetic, a fraction of a microsecond per range
    ops: Sequence[tuple[int, buffer]]                        # any buffers, one per op
        (remote offset, local buffer): each buffer is inspected per op (type, contiguity,
        and its address where a merge is possible), up to about a microsecond each

    read:  local <- remote[offset : offset + nbytes]
    write: remote[offset : offset + nbytes] <- local

Ranges (ops) whose remote and local bytes both follow on from the previous one's are merged
into one copy (consecutive blocks of one pool into consecutive slots: one memcpy). Both
forms normalize to the same list of ``(remote offset, flat uint8 view)`` copies that every
backend executes.

The remote side only allocated the ranges beforehand (a shard's ``begin_put`` or
``acquire``) and publishes them on the control path; it takes no part in the copy.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
from numpy.lib.stride_tricks import as_strided

from store.block_key import address_of, as_byte_view
from store.kv_store_errors import InvalidBlockError, TransferError

CopyOps = Sequence[tuple[int, Any]]
Ranges = Sequence[tuple[int, int, int]]  # (remote offset, local offset, nbytes)
Copies = list[tuple[int, np.ndarray]]  # normalized: (remote offset, flat uint8 view)

_U8 = np.dtype(np.uint8)


@dataclass(frozen=True)
class CollectiveAddress:
    """Where a ``CollectiveServer`` serves a segment through ``kind`` ("gloo" or "nccl")
    process groups (``collective_backend.py``)."""

    host: str
    port: int  # its control socket
    token: str
    kind: str


@dataclass(frozen=True)
class Endpoint:
    endpoint_id: str
    node_id: str
    segment_name: str | None = None  # shared-memory segment, reachable on node_id only
    segment_bytes: int = 0
    tcp_host: str | None = None  # where a TcpServer serves the segment, if any
    tcp_port: int | None = None
    token: str = ""  # the TcpServer's shared secret
    nixl_meta: bytes | None = None  # the owner's NIXL agent metadata, if it serves NIXL
    nixl_base: int = 0  # the segment's address in the owner's process (NIXL descriptors)
    collective: CollectiveAddress | None = None  # where a CollectiveServer serves it, if any

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        if self.tcp_host is None or self.tcp_port is None:
            return None
        return self.tcp_host, self.tcp_port


class LocalMemory:
    """Local buffers registered once for range transfers (Mooncake's ``register_memory``).

    ``LocalMemory(buf0, buf1, ...)``: each buffer is anything ``as_byte_view`` accepts (a
    C-contiguous numpy array, CPU torch tensor, bytes-like) and is checked here, once. Local
    offsets address the buffers as if laid back to back: buffer ``i`` holds local bytes
    ``[starts[i], starts[i] + sizes[i])``; a range must lie inside one buffer. A paged KV
    cache registered as ``LocalMemory(k0, v0, k1, v1, ...)`` thus puts piece (layer ``l``,
    K=0/V=1 ``k``, block ``b``) at local offset ``((2 * l + k) * num_blocks + b) * piece``.

    Holds views of the buffers (keeping them alive) and no copy of their bytes. With no
    buffers it holds no bytes: only an empty list of ranges fits it.
    """

    __slots__ = ("views", "starts", "sizes", "ends", "writable", "nbytes")

    def __init__(self, *buffers: Any) -> None:
        self.views: list[np.ndarray] = [as_byte_view(b) for b in buffers]
        self.sizes: list[int] = [v.size for v in self.views]
        self.starts: list[int] = []
        self.ends: list[int] = []
        total = 0
        for size in self.sizes:
            self.starts.append(total)
            total += size
            self.ends.append(total)
        self.nbytes = total
        self.writable: list[bool] = [bool(v.flags.writeable) for v in self.views]

    @classmethod
    def of(cls, local: Any) -> LocalMemory:
        """``local`` itself if registered already, else one buffer registered now."""
        return local if isinstance(local, LocalMemory) else cls(local)

    def __repr__(self) -> str:
        return f"LocalMemory({len(self.views)} buffers, {self.nbytes} bytes)"


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidBlockError(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


def normalize_ranges(local: Any, ranges: Ranges, segment_bytes: int, writable: bool) -> Copies:
    """Validate ``(remote offset, local offset, nbytes)`` ranges of ``local`` (a
    ``LocalMemory``, or one buffer) against a remote segment of ``segment_bytes`` and merge
    contiguous runs; ``writable``: the local bytes receive data (a read)."""
    mem = LocalMemory.of(local)
    if isinstance(ranges, np.ndarray):
        ranges = ranges.tolist()
    views, starts, ends = mem.views, mem.starts, mem.ends
    single = len(views) == 1
    limit = ends[0] if single else 0
    out: Copies = []
    # the current run: buffer, remote and local start, one past its remote and local end
    run_i = run_r = run_l = 0
    r_end = l_end = -1  # -1: no run yet
    for item in ranges:
        try:
            r, lo, n = item
        except (TypeError, ValueError):
            raise InvalidBlockError(
                "each range must be (remote offset, local offset, nbytes)"
            ) from None
        if type(r) is not int or type(lo) is not int or type(n) is not int:
            r = _as_int(r, "remote offset")
            lo = _as_int(lo, "local offset")
            n = _as_int(n, "nbytes")
        if single:
            i = 0
            if n <= 0 or r < 0 or lo < 0 or r + n > segment_bytes or lo + n > limit:
                _refuse(mem, r, lo, n, segment_bytes)
        else:
            i = bisect_right(starts, lo) - 1
            if i < 0 or n <= 0 or r < 0 or r + n > segment_bytes or lo + n > ends[i]:
                _refuse(mem, r, lo, n, segment_bytes)
        if r == r_end and lo == l_end and i == run_i:
            r_end += n  # continues the run remotely and locally
            l_end += n
            continue
        if writable and not mem.writable[i]:
            raise InvalidBlockError("a read needs writable local buffers")
        if l_end >= 0:
            base = run_l - starts[run_i]
            out.append((run_r, views[run_i][base : base + l_end - run_l]))
        run_i, run_r, run_l, r_end, l_end = i, r, lo, r + n, lo + n
    if l_end >= 0:
        base = run_l - starts[run_i]
        out.append((run_r, views[run_i][base : base + l_end - run_l]))
    return out


def _refuse(mem: LocalMemory, r: int, lo: int, n: int, segment_bytes: int) -> NoReturn:
    """The error for a range that failed the checks of ``normalize_ranges``."""
    if n <= 0:
        raise InvalidBlockError(f"range nbytes must be positive, got {n}")
    if r < 0 or r + n > segment_bytes:
        raise TransferError(
            f"range [{r}, {r + n}) lies outside the remote segment of {segment_bytes} bytes"
        )
    where = "the local memory" if len(mem.views) == 1 else "one registered local buffer"
    raise InvalidBlockError(
        f"local range [{lo}, {lo + n}) lies outside {where} "
        f"({mem.nbytes} bytes in {len(mem.views)} buffer(s))"
    )


def normalize_ops(ops: CopyOps, segment_bytes: int, writable: bool) -> Copies:
    """Validate ``ops`` against a remote segment of ``segment_bytes``; local buffers become
    flat uint8 views, contiguous runs one view. ``writable``: the local buffers receive
    data (a read)."""
    out: Copies = []
    # the current run: its remote start, its views, the address just past it (None: not
    # computed yet; only needed when the next op continues the run remotely)
    run_off = 0
    run: list[np.ndarray] = []
    run_bytes = 0
    run_end: int | None = None
    for item in ops:
        try:
            offset, buf = item
        except (TypeError, ValueError):
            raise InvalidBlockError("each copy op must be (remote offset, local buffer)") from None
        if type(offset) is not int:
            offset = _as_int(offset, "remote offset")
        if (
            type(buf) is np.ndarray
            and buf.dtype is _U8
            and buf.ndim == 1
            and buf.flags.c_contiguous
            and buf.size
        ):
            view = buf  # already a flat byte view (as_byte_view's fast path, inlined)
        else:
            view = as_byte_view(buf)
        size = view.size
        if writable and not view.flags.writeable:
            raise InvalidBlockError("a read needs writable local buffers")
        if offset < 0 or offset + size > segment_bytes:
            raise TransferError(
                f"range [{offset}, {offset + size}) lies outside the remote segment "
                f"of {segment_bytes} bytes"
            )
        if run and run_off + run_bytes == offset:  # continues remotely: locally too?
            if run_end is None:
                run_end = address_of(run[-1]) + run[-1].size
            addr = address_of(view)
            if addr == run_end:
                run.append(view)
                run_bytes += size
                run_end = addr + size
                continue
            _flush(out, run_off, run, run_bytes)
            run_off, run, run_bytes, run_end = offset, [view], size, addr + size
            continue
        if run:
            _flush(out, run_off, run, run_bytes)
        run_off, run, run_bytes, run_end = offset, [view], size, None
    if run:
        _flush(out, run_off, run, run_bytes)
    return out


def _flush(out: Copies, offset: int, run: list[np.ndarray], nbytes: int) -> None:
    if len(run) == 1:
        out.append((offset, run[0]))
    else:  # one view over the run: exactly the bytes of its ops, back to back
        out.append((offset, as_strided(run[0], shape=(nbytes,), strides=(1,))))
