"""Shared fixtures: every block pool a test creates must pass its integrity check afterwards."""

from __future__ import annotations

import weakref

import pytest

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
