"""C++ extensions compiled on first use with ``-march=native``, then cached.

Built through ``torch.utils.cpp_extension`` with the machine's C++ compiler. The build's name
carries a digest of the CPU's feature flags and of the sources: a node with other CPU
features (a shared home folder) never loads a build it cannot run, and two checkouts (whose
build files name their own source paths) never rebuild over each other's or wait on each
other's build lock. Where a build fails (no compiler, no
headers), :meth:`CompiledExtension.load` returns None once, logs why, and keeps the reason
in :meth:`CompiledExtension.error`, so callers keep serving on torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return ""


class CompiledExtension:
    """One extension module: ``sources`` (the first defines the Python module), ``headers``
    they include (from the sources' folder), and ``switch``, an environment variable that
    turns it off when set to 0."""

    def __init__(
        self, name: str, sources: Sequence[Path], headers: Sequence[Path] = (), *, switch: str
    ) -> None:
        self.name = name
        self.sources = list(sources)
        self.headers = list(headers)
        self.switch = switch
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._error: str | None = None

    def build_name(self) -> str:
        identity = f"{platform.machine()} {_cpu_flags()} {' '.join(FLAGS)}".encode()
        identity += str(self.sources[0].resolve().parent).encode()
        identity += b"".join(path.read_bytes() for path in self.sources + self.headers)
        return f"{self.name}_{hashlib.sha1(identity).hexdigest()[:10]}"

    def enabled(self) -> bool:
        return os.environ.get(self.switch, "1") != "0"

    def load(self) -> ModuleType | None:
        """The built module, or None (the reason is logged once and kept in :meth:`error`)."""
        if self._module is not None or self._error is not None:
            return self._module
        with self._lock:
            if self._module is None and self._error is None:
                if not self.enabled():
                    self._error = f"turned off by {self.switch}=0"
                    return None
                try:
                    from torch.utils.cpp_extension import load as build

                    self._module = build(
                        name=self.build_name(),
                        sources=[str(path) for path in self.sources],
                        extra_include_paths=[str(self.sources[0].parent)],
                        extra_cflags=FLAGS,
                        verbose=False,
                    )
                except Exception as exc:  # a missing compiler or headers: keep serving on torch
                    self._error = f"{type(exc).__name__}: {exc}"
                    logger.warning("%s unavailable, using torch: %s", self.name, self._error)
        return self._module

    def require(self) -> ModuleType:
        """The built module; RuntimeError with the reason where it cannot be had."""
        module = self.load()
        if module is None:
            raise RuntimeError(f"{self.name} is unavailable: {self._error}")
        return module

    def error(self) -> str | None:
        """Why the module is not in use, once :meth:`load` has been tried; None if it is."""
        return self._error
