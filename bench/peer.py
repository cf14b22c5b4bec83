"""The peer a serving bench compares against: vLLM's OpenAI API server (its CPU backend,
installed in a venv of its own) on the same weights, started as docs/benchmarks.md's
commands start it, on a free local port; ``vllm_server`` yields its URL and served model
name once ``/v1/models`` answers, and stops it after (its log is kept and printed if it failed)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.app_probe import free_port, served_model, wait_for
from bench.session import exited, start_session, stop_session


@contextlib.contextmanager
def vllm_server(
    python: str,
    model_dir: str,
    name: str = "bench",
    memory_share: float = 0.25,
    threads: int = 1,
    extra: tuple[str, ...] = (),
    timeout_s: float = 900.0,
) -> Iterator[tuple[str, str]]:
    """``python -m vllm.entrypoints.openai.api_server`` (``python``: the peer venv's
    interpreter) serving ``model_dir`` as ``name`` in fp32; ``memory_share`` is
    ``--gpu-memory-utilization``, which bounds its memory on CPU (the default fails beside
    Ray); ``threads`` its OMP threads. Yields (URL, served model name)."""
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="peer-"))
    log = tmp / "vllm.log"
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    cmd += ["--served-model-name", name, "--dtype", "float32", "--host", "127.0.0.1"]
    cmd += ["--gpu-memory-utilization", str(memory_share), "--port", str(port), *extra]
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    proc = start_session(cmd, log, env)
    url = f"http://127.0.0.1:{port}"
    clean = False
    try:
        served = wait_for(
            lambda: served_model(url),
            f"vLLM's server did not answer (see {log})",
            timeout_s,
            gone=lambda: exited(proc),
            every_s=1.0,
        )
        yield url, served
        clean = True
    finally:
        stop_session(proc, grace_s=30)
        if clean:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"vLLM's log: {log}; its last lines:", file=sys.stderr)
            print(log.read_text()[-3000:], file=sys.stderr)
