"""The test processes' ``ray.init`` starts a node once more after a start-up timeout, and
only then."""

from __future__ import annotations

import pytest
from ray_start import retrying_startup_timeout


class FakeRay:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls: list[tuple] = []
        self.shutdowns = 0

    def init(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.failures:
            raise self.failures.pop(0)
        return "context"

    def shutdown(self):
        self.shutdowns += 1


TIMEOUT = Exception("The current node timed out during startup. This could happen ...")


def test_a_start_up_timeout_is_retried_once_with_the_same_arguments(capsys):
    fake = FakeRay([TIMEOUT])
    init = retrying_startup_timeout(fake.init, fake.shutdown)
    assert init("local", num_cpus=2) == "context"
    assert fake.calls == [(("local",), {"num_cpus": 2})] * 2 and fake.shutdowns == 1
    assert "Starting the node once more" in capsys.readouterr().err


def test_a_second_timeout_and_any_other_failure_are_raised():
    fake = FakeRay([TIMEOUT, TIMEOUT])
    with pytest.raises(Exception, match="timed out during startup"):
        retrying_startup_timeout(fake.init, fake.shutdown)()
    assert len(fake.calls) == 2
    other = FakeRay([ValueError("bad address")])
    with pytest.raises(ValueError, match="bad address"):
        retrying_startup_timeout(other.init, other.shutdown)()
    assert len(other.calls) == 1 and other.shutdowns == 0
