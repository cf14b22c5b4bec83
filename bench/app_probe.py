"""What every bench asks of a server it started: a free local port to put it on, whether
``/health`` answers 200 counting the expected replicas (``healthy``), which model it
serves once it answers (``served_model``, for apps and peer servers alike), and a wait
for any of these (``wait_for``, ``wait_healthy``)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")


_handed: list[range] = []  # every range ``free_port`` gave out in this process


def free_port(span: int = 1) -> int:
    """A local port ``p`` such that ``p .. p + span - 1`` are free now and overlap no range
    handed out before in this process: two apps a bench starts side by side (each with a
    proxy port and a direct-ingress range) never get one another's ports."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = int(s.getsockname()[1])
        ports = range(first, first + span)
        if ports.stop > 65536 or any(_overlap(ports, r) for r in _handed):
            continue
        if all(_bindable(p) for p in ports[1:]):
            _handed.append(ports)
            return first


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def healthy(url: str, replicas: int) -> bool:
    """``/health`` answers 200 and counts exactly ``replicas`` live replicas."""
    try:
        r = httpx.get(url + "/health", timeout=5)
        return r.status_code == 200 and r.json().get("replicas") == replicas
    except (httpx.HTTPError, ValueError):
        return False


def served_model(url: str) -> str | None:
    """The model id an OpenAI server serves, once it answers ``/health`` and
    ``/v1/models``; None before."""
    try:
        if httpx.get(url + "/health", timeout=5).status_code != 200:
            return None
        r = httpx.get(url + "/v1/models", timeout=5)
        return str(r.json()["data"][0]["id"]) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def wait_for(
    probe: Callable[[], T | None],
    what: str,
    timeout_s: float = 600.0,
    gone: Callable[[], str | None] = lambda: None,
    every_s: float = 0.5,
) -> T:
    """``probe()`` every ``every_s`` until it answers (not None or False); TimeoutError
    naming ``what`` after ``timeout_s``, RuntimeError with ``gone()``'s reason as soon as
    that says the server is gone (its process exited)."""
    deadline = time.monotonic() + timeout_s
    while (answer := probe()) is None or answer is False:
        if (reason := gone()) is not None:
            raise RuntimeError(f"{what}: {reason}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        time.sleep(every_s)
    return answer


def wait_healthy(url: str, replicas: int, timeout_s: float = 600.0) -> None:
    """Until ``healthy``; TimeoutError naming the URL after ``timeout_s``."""
    wait_for(
        lambda: healthy(url, replicas),
        f"{url} did not become healthy with {replicas} replicas",
        timeout_s,
    )
