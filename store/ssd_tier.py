"""The SSD tier of a store shard: one real file per block under a folder, bounded in bytes.

File layout (little-endian): a 40-byte header, then the block's bytes.
    magic "MKV1" | u8 has_parent | 3 pad | u32 crc32(payload) | u64 hash | u64 parent | u64 n
A file is named ``<hash as 16 hex digits>.kv``. A write goes to a hidden temporary file in
the same folder and is renamed into place only after every byte is written, so a block is
visible only once complete; a writer that dies mid-write leaves a temporary file that is
never read and is deleted when a tier opens the folder again. Reads check the header and the
CRC, so a torn file (e.g. renamed but not flushed before a power loss, when ``fsync`` is off)
reads as a miss and is deleted, never as wrong KV.

Invariants: ``used_bytes`` (header + payload of every visible file) ``<= capacity_bytes``;
the LRU order (oldest first) holds exactly the visible blocks. Like the DRAM tier it never
evicts on its own; the shard picks victims. Opening a folder that already holds blocks
(a restarted shard) adopts them, oldest modification time first in LRU order.
"""

from __future__ import annotations

import os
import secrets
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from store.kv_store_errors import InvalidBlockError, StoreFullError

HEADER = struct.Struct("<4sB3xIQQQ")
MAGIC = b"MKV1"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"


class SsdTier:
    def __init__(self, folder: str | os.PathLike[str], capacity_bytes: int, fsync: bool = False):
        if capacity_bytes <= 0:
            raise InvalidBlockError(f"SSD capacity must be positive, got {capacity_bytes}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._files: dict[int, int] = {}  # hash -> payload nbytes
        self._parents: dict[int, int | None] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.used_bytes = 0
        self._recover()

    def __len__(self) -> int:
        return len(self._files)

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._files

    def nbytes(self, block_hash: int) -> int:
        return self._files[block_hash]

    def parent(self, block_hash: int) -> int | None:
        return self._parents[block_hash]

    def path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash:016x}{SUFFIX}"

    def file_bytes(self, nbytes: int) -> int:
        """What a block of ``nbytes`` costs against the capacity."""
        return HEADER.size + nbytes

    def has_room(self, nbytes: int) -> bool:
        return self.used_bytes + self.file_bytes(nbytes) <= self.capacity_bytes

    # -- writes ----------------------------------------------------------------------------
    def write(self, block_hash: int, data: np.ndarray, parent: int | None = None) -> None:
        """Write ``data`` (flat uint8) as a visible file. The caller made room first."""
        nbytes = int(data.size)
        if self.file_bytes(nbytes) > self.capacity_bytes:
            raise InvalidBlockError(
                f"a block of {nbytes} bytes exceeds the SSD tier's {self.capacity_bytes} bytes"
            )
        if not self.has_room(nbytes):
            raise StoreFullError("SSD tier is full; evict a block first")
        if block_hash in self._files:
            raise InvalidBlockError(f"block {block_hash:#x} is already on SSD")
        header = HEADER.pack(
            MAGIC,
            parent is not None,
            zlib.crc32(data.data) & 0xFFFFFFFF,
            block_hash,
            parent or 0,
            nbytes,
        )
        tmp = self.folder / f".{block_hash:016x}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(data.data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.path(block_hash))  # atomic: visible only when complete
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._add(block_hash, nbytes, parent)

    # -- reads -----------------------------------------------------------------------------
    def read_into(self, block_hash: int, out: np.ndarray) -> bool:
        """Copy the block into ``out`` (flat uint8 of its size). False, and the file is
        dropped, if the file is gone or fails its header/CRC check."""
        nbytes = self._files[block_hash]
        if out.size != nbytes:
            raise InvalidBlockError(f"read buffer holds {out.size} bytes, block has {nbytes}")
        try:
            with open(self.path(block_hash), "rb") as f:
                head = f.read(HEADER.size)
                ok = self._header_ok(head, block_hash, nbytes)
                if ok:
                    got = f.readinto(out.data)
                    ok = (
                        got == nbytes
                        and zlib.crc32(out.data) & 0xFFFFFFFF == HEADER.unpack(head)[2]
                    )
        except FileNotFoundError:
            ok = False
        if not ok:
            self.remove(block_hash)
        return ok

    def touch(self, block_hash: int) -> None:
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)

    def lru_order(self) -> Iterator[int]:
        """Visible hashes, least recently used first. Pick a victim, stop, then remove."""
        return iter(self._lru)

    # -- removal ---------------------------------------------------------------------------
    def remove(self, block_hash: int) -> None:
        nbytes = self._files.pop(block_hash)
        del self._lru[block_hash]
        del self._parents[block_hash]
        self.used_bytes -= self.file_bytes(nbytes)
        self.path(block_hash).unlink(missing_ok=True)

    # -- internals -------------------------------------------------------------------------
    def _add(self, block_hash: int, nbytes: int, parent: int | None) -> None:
        self._files[block_hash] = nbytes
        self._parents[block_hash] = parent
        self._lru[block_hash] = None
        self.used_bytes += self.file_bytes(nbytes)

    @staticmethod
    def _header_ok(head: bytes, block_hash: int, nbytes: int) -> bool:
        if len(head) != HEADER.size:
            return False
        magic, _, _, h, _, n = HEADER.unpack(head)
        return magic == MAGIC and h == block_hash and n == nbytes

    def _recover(self) -> None:
        """Adopt complete files left by an earlier shard; delete temporary ones."""
        for tmp in self.folder.glob(f".*{TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
        found = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    head = f.read(HEADER.size)
            except OSError:
                continue
            if len(head) != HEADER.size:
                path.unlink(missing_ok=True)
                continue
            magic, has_parent, _, h, parent, n = HEADER.unpack(head)
            if magic != MAGIC or path.name != f"{h:016x}{SUFFIX}" or st.st_size != HEADER.size + n:
                path.unlink(missing_ok=True)  # torn or foreign: never served
                continue
            found.append((st.st_mtime_ns, h, n, parent if has_parent else None))
        for _, h, n, parent in sorted(found):
            if not self.has_room(n):
                self.path(h).unlink(missing_ok=True)
                continue
            self._add(h, n, parent)
