"""Unit tests run without Ray: starting it here is a bug in the test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def refuse_ray(monkeypatch):
    try:
        import ray
    except ImportError:
        yield
        return

    def _refuse(*args, **kwargs):
        raise RuntimeError("unit tests must not start Ray; move this test to tests/integration")

    monkeypatch.setattr(ray, "init", _refuse)
    yield
