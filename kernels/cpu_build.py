"""C++ extensions compiled on first use with ``-march=native``, then cached.

Built through ``torch.utils.cpp_extension`` with the machine's C++ compiler, from a copy of
the sources inside the build's own folder (``build_root() / build_name()``). The name
carries a digest of the CPU's feature flags, the compiler flags, Python's and torch's
versions and the sources' bytes, never their path: a node with other CPU features (a shared
home folder) never loads a build it cannot run, and every copy of the same sources (another
checkout, a Ray job's uploaded working dir, a fresh clone's new virtual environment) loads
the one build that the first ``make setup`` made instead of compiling again (about two
minutes on two cores): a build marked complete is imported from its shared library as it
is, since torch's ninja file names the virtual environment's include paths. Where a build
fails (no compiler, no headers), :meth:`CompiledExtension.load` returns None once, logs
why, and keeps the reason in :meth:`CompiledExtension.error`, so callers keep serving on
torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"]


# written into a build's folder once its module was compiled and imported
COMPLETE = "complete"


def _import_built(directory: Path) -> ModuleType:
    """The module of a complete build, imported from its shared library without ninja: torch
    writes ``build.ninja`` with this virtual environment's include paths, and ninja would
    compile everything again for a command line that differs only there."""
    import importlib.util

    import torch  # noqa: F401  (the library's libtorch symbols resolve against it)

    path = directory / f"{directory.name}.so"
    spec = importlib.util.spec_from_file_location(directory.name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return ""


def _torch_version() -> str:
    import torch

    return torch.__version__


def build_root() -> Path:
    """Where builds live: ``TORCH_EXTENSIONS_DIR`` if set, else the user's cache
    (``$XDG_CACHE_HOME`` or ``~/.cache``) ``/meridian-kernels``: shared by every checkout,
    virtual environment and Ray job of the user, each build named by its content."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "meridian-kernels"


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
        identity = f"{platform.machine()} {_cpu_flags()} {' '.join(FLAGS)}"
        identity += f" {sys.version_info[:2]} {_torch_version()}"
        digest = hashlib.sha1(identity.encode())
        for path in self.sources + self.headers:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return f"{self.name}_{digest.hexdigest()[:10]}"

    def build_directory(self) -> Path:
        return build_root() / self.build_name()

    def _stage_sources(self, folder: Path) -> list[Path]:
        """Copies of the sources and headers in ``folder`` (written only where missing or
        different, atomically, so a build in progress never reads half a file and an
        unchanged copy keeps the timestamp ninja compares); returns the sources' copies."""
        folder.mkdir(parents=True, exist_ok=True)
        for path in self.sources + self.headers:
            data = path.read_bytes()
            copy = folder / path.name
            if not copy.exists() or copy.read_bytes() != data:
                partial = folder / f".{path.name}.{os.getpid()}"
                partial.write_bytes(data)
                os.replace(partial, copy)
        return [folder / path.name for path in self.sources]

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
                    directory = self.build_directory()
                    if (directory / COMPLETE).exists():
                        self._module = _import_built(directory)
                    else:
                        self._module = self._build(directory)
                except Exception as exc:  # a missing compiler or headers: keep serving on torch
                    self._error = f"{type(exc).__name__}: {exc}"
                    logger.warning("%s unavailable, using torch: %s", self.name, self._error)
        return self._module

    def _build(self, directory: Path) -> ModuleType:
        """Compile (ninja, through torch) and import; then mark the build complete."""
        from torch.utils.cpp_extension import load as build

        sources = self._stage_sources(directory / "src")
        module = build(
            name=directory.name,
            sources=[str(path) for path in sources],
            extra_include_paths=[str(directory / "src")],
            extra_cflags=FLAGS,
            build_directory=str(directory),
            verbose=False,
        )
        partial = directory / f".{COMPLETE}.{os.getpid()}"
        partial.write_text(module.__file__ or "")
        os.replace(partial, directory / COMPLETE)
        return module

    def require(self) -> ModuleType:
        """The built module; RuntimeError with the reason where it cannot be had."""
        module = self.load()
        if module is None:
            raise RuntimeError(f"{self.name} is unavailable: {self._error}")
        return module

    def error(self) -> str | None:
        """Why the module is not in use, once :meth:`load` has been tried; None if it is."""
        return self._error
