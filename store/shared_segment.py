"""A named shared-memory segment that several processes on one node map at once.

One process creates the segment (``SharedSegment.create``) and owns it: ``close()`` in the
owner also unlinks the name. Other processes ``attach`` by name and only unmap on close.
Segments are files under a tmpfs folder (``/dev/shm`` on Linux), mapped with ``MAP_SHARED``;
attaching pre-faults the mapping (``MAP_POPULATE``) so the first copy out of it runs at
memcpy speed instead of paying a page fault per 4 KiB.

Names are ``meridian-kv-<pid>-<hex>``, and the owner holds a shared ``flock`` on the file
while it lives: a segment whose creator died (a killed shard or replica never unlinks its
file) is one whose pid is gone and whose lock nobody holds, in any pid namespace that shares
the folder. ``create`` removes such segments first (``remove_stale_segments``), so killed
processes cannot fill the node's shared memory. The mapping stays valid in a process that
attached it even after the owner unlinked it; it is freed when the last mapping goes.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
from pathlib import Path

import numpy as np

from store.kv_store_errors import InvalidBlockError, TransferError

DEFAULT_SHM_DIR = "/dev/shm"
PREFIX = "meridian-kv-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedSegment:
    """``nbytes`` of shared memory; ``array`` is a writable flat ``uint8`` view of it."""

    def __init__(
        self, name: str, nbytes: int, mm: mmap.mmap, path: Path, owner_fd: int | None
    ) -> None:
        self.name = name
        self.nbytes = nbytes
        self.path = path
        self.owner = owner_fd is not None
        self._owner_fd = owner_fd  # open, with a shared flock, while the owner lives
        self._mmap: mmap.mmap | None = mm
        self.array = np.frombuffer(mm, dtype=np.uint8, count=nbytes)

    @classmethod
    def create(
        cls, nbytes: int, shm_dir: str = DEFAULT_SHM_DIR, prefault: bool = True
    ) -> SharedSegment:
        """A new zero-filled segment of ``nbytes``; ``prefault`` touches every page now so
        later copies into it do not fault."""
        if nbytes <= 0:
            raise InvalidBlockError(f"segment size must be positive, got {nbytes}")
        folder = Path(shm_dir)
        if not folder.is_dir():
            raise TransferError(
                f"shared-memory folder {shm_dir!r} does not exist; pass shm_dir= a tmpfs folder"
            )
        remove_stale_segments(shm_dir)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = folder / name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _populate_flag())
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        seg = cls(name, nbytes, mm, path, owner_fd=fd)
        if prefault:
            seg.prefault()
        return seg

    @classmethod
    def attach(cls, name: str, nbytes: int, shm_dir: str = DEFAULT_SHM_DIR) -> SharedSegment:
        """Map an existing segment created by another process on this node."""
        if not name.startswith(PREFIX) or "/" in name:
            raise TransferError(f"{name!r} is not a Meridian shared-memory segment name")
        path = Path(shm_dir) / name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise TransferError(
                f"shared-memory segment {name!r} is gone (its owner exited or is on another node)"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise TransferError(f"segment {name!r} holds {size} bytes, expected {nbytes}")
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _populate_flag())
        finally:
            os.close(fd)
        return cls(name, nbytes, mm, path, owner_fd=None)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def prefault(self) -> None:
        """Allocate every page now (one write per page), so later copies do not fault."""
        self.array[:: mmap.PAGESIZE] = 0

    def release_pages(self) -> int:
        """Give the segment's memory back to the node (the owner only): its pages are
        freed in every process that maps it (``MADV_REMOVE``) and read as zeros when
        touched again; the name and every mapping stay valid. Returns the bytes freed."""
        mm, fd = self._mmap, self._owner_fd
        if mm is None or fd is None:
            raise TransferError(f"segment {self.name!r}: only its live owner frees its pages")
        if not hasattr(mmap, "MADV_REMOVE"):
            raise TransferError("freeing shared-memory pages needs Linux (MADV_REMOVE)")
        before = os.fstat(fd).st_blocks
        mm.madvise(mmap.MADV_REMOVE)
        return 512 * (before - os.fstat(fd).st_blocks)  # st_blocks counts 512-byte units

    def close(self) -> None:
        """Unmap (and unlink, in the owner). Views of ``array`` must be dropped first; if
        some are still alive the mapping is left to the garbage collector."""
        mm, self._mmap = self._mmap, None
        if mm is None:
            return
        self.array = np.empty(0, dtype=np.uint8)
        try:
            mm.close()
        except BufferError:  # a view still exports the buffer; the GC unmaps later
            pass
        if self._owner_fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._owner_fd)
            self._owner_fd = None

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _populate_flag() -> int:
    return getattr(mmap, "MAP_POPULATE", 0)


def remove_stale_segments(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Unlink segments whose creating process is dead and whose owner's lock nobody holds
    (a live owner in another pid namespace keeps its lock); returns their names."""
    removed: list[str] = []
    folder = Path(shm_dir)
    if not folder.is_dir():
        return removed
    for path in folder.glob(PREFIX + "*"):
        try:
            pid = int(path.name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid) and not _locked(path):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _locked(path: Path) -> bool:
    """Whether some process holds the owner's lock on ``path`` (True if it cannot be read)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock, if it got one
    return False
