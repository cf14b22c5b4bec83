"""The ingress's side of regions: a balancer marked down by a health check that timed out
under load still serves a region whose own balancer is gone, rather than a 503."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.serving.region_entry import RegionEntry


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _Balancer:
    """A region balancer in process: ``alive`` False makes every call raise."""

    def __init__(self, region: str) -> None:
        self.region, self.alive = region, True
        self.adopted: list[str] = []
        self.released: list[str] = []
        for name in ("status", "adopt", "place", "release"):
            setattr(self, name, _Method(getattr(self, f"_{name}")))

    def _check(self) -> None:
        if not self.alive:
            raise ConnectionError(f"{self.region}'s balancer is dead")

    async def _status(self) -> dict:
        self._check()
        return {}

    async def _adopt(self, region: str) -> None:
        self._check()
        self.adopted.append(region)

    async def _place(self, request: Any) -> str:
        self._check()
        return f"placed by {self.region}"

    async def _release(self, region: str) -> None:
        self.released.append(region)


def test_a_region_with_no_balancer_seen_up_still_tries_the_nearest():
    us, eu = _Balancer("us"), _Balancer("eu")
    entry = RegionEntry({"us": us, "eu": eu}, {("us", "eu"): 0.05})
    us.alive = False
    entry.down["eu"] = 0.0  # a status call timed out under load; eu is in fact up

    async def run() -> str:
        answer = await entry.place(None, "us")  # type: ignore[arg-type]
        entry._watcher.cancel()  # type: ignore[union-attr]
        return answer

    assert asyncio.run(run()) == "placed by eu"
    assert eu.adopted == ["us"] and "eu" not in entry.down and "us" in entry.down
    assert entry.stand_in == {"us": "eu"}


def test_every_balancer_gone_is_refused_with_the_region_named():
    us, eu = _Balancer("us"), _Balancer("eu")
    entry = RegionEntry({"us": us, "eu": eu}, {("us", "eu"): 0.05})
    us.alive = eu.alive = False

    async def run() -> None:
        try:
            await entry.place(None, "us")  # type: ignore[arg-type]
        finally:
            entry._watcher.cancel()  # type: ignore[union-attr]

    with pytest.raises(RuntimeError, match="region 'us'"):
        asyncio.run(run())
    assert set(entry.down) == {"us", "eu"}
