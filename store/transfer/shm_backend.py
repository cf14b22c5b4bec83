"""Same-node transfers: one memcpy between this process's memory and a shared segment.

The remote endpoint's segment is attached (mapped, pre-faulted) on first use and kept
mapped, so every later transfer is the checks of its ranges (integer arithmetic for
``read_ranges``/``write_ranges``) and then the copies: about memcpy speed. Safe against the
remote's own activity because the remote only hands out ranges it reserved or pinned.
"""

from __future__ import annotations

import numpy as np

from store.kv_store_errors import BackendUnavailableError
from store.shared_segment import DEFAULT_SHM_DIR, SharedSegment
from store.transfer.backend import TransferBackend
from store.transfer.endpoint import (
    Copies,
    CopyOps,
    Endpoint,
    LocalMemory,
    Ranges,
    normalize_ops,
    normalize_ranges,
)


class ShmBackend(TransferBackend):
    name = "shm"

    def __init__(self, shm_dir: str = DEFAULT_SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self._segments: dict[str, SharedSegment] = {}  # segment name -> mapping

    def segment(self, remote: Endpoint) -> SharedSegment:
        """The remote's mapped segment (attached on first use)."""
        name = remote.segment_name
        if name is None:
            raise BackendUnavailableError(
                f"endpoint {remote.endpoint_id!r} publishes no shared-memory segment"
            )
        seg = self._segments.get(name)
        if seg is None:
            seg = SharedSegment.attach(name, remote.segment_bytes, self.shm_dir)
            self._segments[name] = seg
        return seg

    def read(self, remote: Endpoint, ops: CopyOps) -> int:
        src = self.segment(remote).array
        return _copy_in(src, normalize_ops(ops, remote.segment_bytes, writable=True))

    def write(self, remote: Endpoint, ops: CopyOps) -> int:
        dst = self.segment(remote).array
        return _copy_out(dst, normalize_ops(ops, remote.segment_bytes, writable=False))

    def read_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        src = self.segment(remote).array
        return _copy_in(src, normalize_ranges(local, ranges, remote.segment_bytes, True))

    def write_ranges(self, remote: Endpoint, local: LocalMemory, ranges: Ranges) -> int:
        dst = self.segment(remote).array
        return _copy_out(dst, normalize_ranges(local, ranges, remote.segment_bytes, False))

    def forget(self, remote: Endpoint) -> None:
        if remote.segment_name is not None:
            seg = self._segments.pop(remote.segment_name, None)
            if seg is not None:
                seg.close()

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()


def _copy_in(src: np.ndarray, copies: Copies) -> int:
    total = 0
    for offset, buf in copies:
        n = buf.size
        np.copyto(buf, src[offset : offset + n])
        total += n
    return total


def _copy_out(dst: np.ndarray, copies: Copies) -> int:
    total = 0
    for offset, buf in copies:
        n = buf.size
        np.copyto(dst[offset : offset + n], buf)
        total += n
    return total
