"""What every bench that starts a Serve app asks of it: a free local port to put it on,
whether ``/health`` answers 200 counting the expected replicas, and a wait for that."""

from __future__ import annotations

import socket
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str, replicas: int) -> bool:
    """``/health`` answers 200 and counts exactly ``replicas`` live replicas."""
    try:
        r = httpx.get(url + "/health", timeout=5)
        return r.status_code == 200 and r.json().get("replicas") == replicas
    except (httpx.HTTPError, ValueError):
        return False


def wait_healthy(url: str, replicas: int, timeout_s: float = 600.0) -> None:
    """Poll ``healthy`` every half second; TimeoutError naming the URL after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not healthy(url, replicas):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{url} did not become healthy with {replicas} replicas in {timeout_s:g} s"
            )
        time.sleep(0.5)
