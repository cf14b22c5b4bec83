"""Folders written once into the user's model cache (``$MERIDIAN_CACHE``, default
``~/.cache/meridian``) and read by every process after: one process writes while the others
wait on a lock (one for the whole cache), and the folder appears whole (written aside, then
renamed into place)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MERIDIAN_CACHE") or Path.home() / ".cache" / "meridian")


def cached_folder(name: str, write: Callable[[Path], object], marker: str) -> Path:
    """``cache_root() / name``, made by ``write(folder)`` unless it holds the file ``marker``
    (which every ``write`` creates)."""
    root = cache_root()
    final = root / name
    if (final / marker).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)  # the lock is on the cache folder itself: no lock file
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not (final / marker).is_file():  # else written while this process waited
            shutil.rmtree(final, ignore_errors=True)  # left incomplete by an older writer
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
            os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is shared
            try:
                write(staging)
                os.rename(staging, final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    finally:
        os.close(fd)  # releases the lock
    return final
