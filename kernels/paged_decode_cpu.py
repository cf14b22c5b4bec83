"""The CPU decode-attention kernel (``paged_decode_cpu.cpp``): built on first use, then cached.

Decode rows (one query each) are most of a serving step's attention. The torch path gathers
each sequence's K and V blocks into a padded copy before its kernel reads them, so every
cached byte is copied once and read twice; this kernel reads each block where it lies. It is
compiled with the machine's C++ compiler through ``torch.utils.cpp_extension`` (about 20 s
here the first time; later processes load the cached build, about 1 s). Where it cannot be
built, :func:`load` says why and the torch path is used.
``MERIDIAN_CPU_DECODE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]
_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


def _build_name() -> str:
    """The extension's name, one per CPU feature set and source: the build is
    ``-march=native``, so a node with other CPU features (a shared home folder) must not load
    it, and two checkouts with different sources must not rebuild over each other's build."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    identity = f"{platform.machine()} {flags} {' '.join(_FLAGS)}".encode() + _SOURCE.read_bytes()
    digest = hashlib.sha1(identity).hexdigest()[:10]
    return f"meridian_paged_decode_cpu_{digest}"


def enabled() -> bool:
    return os.environ.get("MERIDIAN_CPU_DECODE_KERNEL", "1") != "0"


def load() -> ModuleType | None:
    """The built extension, or None (the reason is logged once and kept in :func:`error`)."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    with _lock:
        if _module is None and _error is None:
            if not enabled():
                _error = "turned off by MERIDIAN_CPU_DECODE_KERNEL=0"
                return None
            try:
                from torch.utils.cpp_extension import load as build

                _module = build(
                    name=_build_name(),
                    sources=[str(_SOURCE)],
                    extra_cflags=_FLAGS,
                    verbose=False,
                )
            except Exception as exc:  # a missing compiler or headers: keep serving on torch
                _error = f"{type(exc).__name__}: {exc}"
                logger.warning("CPU decode kernel unavailable, using the torch path: %s", _error)
    return _module


def error() -> str | None:
    """Why the kernel is not in use, once :func:`load` has been tried; None if it is."""
    return _error


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [n, Hq, D]`` fp32, caches ``[num_blocks, block_size, Hkv, D]``, ``block_tables
    [n, W]`` int64, ``visible [n]`` int64 (query b sees keys ``0..visible[b]-1``) ->
    ``(out [n, Hq, D], lse [n, Hq] float32)``. Raises RuntimeError if the kernel is not built."""
    module = load()
    if module is None:
        raise RuntimeError(f"the CPU decode kernel is unavailable: {_error}")
    out, lse = module.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables.contiguous(), visible.contiguous(), scale
    )
    return out, lse
