"""What one end of a KV transfer publishes, and the copy operations between two ends.

An ``Endpoint`` is a small picklable descriptor: it travels on the control path (a Ray call,
a compiled-graph plan); the KV bytes never do. It names the endpoint's node, its shared
memory segment (readable and writable by processes on the same node) and, when it serves
one, the TCP address and token through which processes on other nodes reach the segment.

A transfer is one-sided, as in Mooncake's transfer engine: the side that moves the bytes
names byte ranges of the *remote* segment, each paired with a *local* buffer:

    ops: Sequence[tuple[int, buffer]]   # (byte offset in the remote segment, local buffer)
    read:  local buffer <- remote[offset : offset + len(buffer)]
    write: remote[offset : offset + len(buffer)] <- local buffer

Ops whose remote ranges and local buffers both follow on from the previous op's are merged
into one copy (consecutive blocks of one pool into consecutive slots: one memcpy).

The remote side only allocated the ranges beforehand (a shard's ``begin_put`` or
``acquire``) and publishes them on the control path; it takes no part in the copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from store.block_key import address_of, as_byte_view
from store.kv_store_errors import InvalidBlockError, TransferError

CopyOps = Sequence[tuple[int, Any]]


@dataclass(frozen=True)
class Endpoint:
    endpoint_id: str
    node_id: str
    segment_name: str | None = None  # shared-memory segment, reachable on node_id only
    segment_bytes: int = 0
    tcp_host: str | None = None  # where a TcpServer serves the segment, if any
    tcp_port: int | None = None
    token: str = ""  # the TcpServer's shared secret

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        if self.tcp_host is None or self.tcp_port is None:
            return None
        return self.tcp_host, self.tcp_port


def normalize_ops(ops: CopyOps, segment_bytes: int, writable: bool) -> list[tuple[int, np.ndarray]]:
    """Validate ``ops`` against a remote segment of ``segment_bytes``; local buffers become
    flat uint8 views. ``writable``: the local buffers receive data (a read)."""
    checked: list[tuple[int, np.ndarray, int]] = []  # (remote offset, view, local address)
    for item in ops:
        try:
            offset, buf = item
        except (TypeError, ValueError):
            raise InvalidBlockError("each copy op must be (remote offset, local buffer)") from None
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
            raise InvalidBlockError(f"remote offset must be an int, got {type(offset).__name__}")
        view = as_byte_view(buf)
        if writable and not view.flags.writeable:
            raise InvalidBlockError("a read needs writable local buffers")
        if offset < 0 or offset + view.size > segment_bytes:
            raise TransferError(
                f"range [{offset}, {offset + view.size}) lies outside the remote segment "
                f"of {segment_bytes} bytes"
            )
        checked.append((int(offset), view, address_of(view)))
    out: list[tuple[int, np.ndarray]] = []
    start = 0
    for i in range(1, len(checked) + 1):
        if i < len(checked):
            prev_off, prev, prev_addr = checked[i - 1]
            off, _, addr = checked[i]
            if prev_off + prev.size == off and prev_addr + prev.size == addr:
                continue  # op i continues op i - 1 remotely and locally
        offset, first, _ = checked[start]
        if i - start == 1:
            out.append((offset, first))
        else:  # one view over the run: exactly the bytes of its ops, back to back
            total = sum(v.size for _, v, _ in checked[start:i])
            out.append((offset, as_strided(first, shape=(total,), strides=(1,))))
        start = i
    return out
