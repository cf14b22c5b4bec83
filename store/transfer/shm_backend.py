"""Same-node transfers: one memcpy between this process's memory and a shared segment.

The remote endpoint's segment is attached (mapped, pre-faulted) on first use and kept
mapped, so every later transfer is just the copy: about memcpy speed. Safe against the
remote's own activity because the remote only hands out ranges it reserved or pinned.
"""

from __future__ import annotations

import numpy as np

from store.kv_store_errors import BackendUnavailableError
from store.shared_segment import DEFAULT_SHM_DIR, SharedSegment
from store.transfer.backend import TransferBackend
from store.transfer.endpoint import CopyOps, Endpoint, normalize_ops


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
        total = 0
        for offset, buf in normalize_ops(ops, remote.segment_bytes, writable=True):
            np.copyto(buf, src[offset : offset + buf.size])
            total += buf.size
        return total

    def write(self, remote: Endpoint, ops: CopyOps) -> int:
        dst = self.segment(remote).array
        total = 0
        for offset, buf in normalize_ops(ops, remote.segment_bytes, writable=False):
            np.copyto(dst[offset : offset + buf.size], buf)
            total += buf.size
        return total

    def forget(self, remote: Endpoint) -> None:
        if remote.segment_name is not None:
            seg = self._segments.pop(remote.segment_name, None)
            if seg is not None:
                seg.close()

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
