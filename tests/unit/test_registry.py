"""``policies.registry.Registry``: names -> entries, lazy imports, errors naming the choices;
and the four tables built on it agree with what their callers accept."""

from __future__ import annotations

import sys
from typing import get_args

import pytest

from actors.serving.config import RoutingPolicyName
from policies.registry import Lazy, Registry
from policies.routing import ROUTING_POLICIES, PowerOfTwoChoices, make_routing_policy
from policies.slack import ORDERINGS, POLICIES
from sim.presets import COLOCATED_POLICIES
from store.kv_store_errors import BackendUnavailableError
from store.transfer.backend import TRANSFER_BACKENDS


def test_unknown_names_the_choices_and_lazy_entries_import_on_get(tmp_path, monkeypatch):
    (tmp_path / "registry_probe_mod.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[object] = Registry("widget", error=KeyError)
    reg.add("b", 2)
    reg.add("a", Lazy("registry_probe_mod", "Thing"))
    assert reg.names() == ("b", "a") and "a" in reg
    with pytest.raises(KeyError, match="unknown widget 'c'; choose one of a, b"):
        reg.get("c")
    assert "registry_probe_mod" not in sys.modules  # not imported until asked for
    assert reg.get("a") is sys.modules["registry_probe_mod"].Thing and reg.get("b") == 2
    monkeypatch.delitem(sys.modules, "registry_probe_mod")
    with pytest.raises(ValueError, match="already registered"):
        reg.add("b", 3)
    reg.add("b", 3, replace=True)
    assert reg.get("b") == 3


def test_a_missing_package_says_what_to_do():
    reg: Registry[object] = Registry("backend")
    reg.add("gone", Lazy("no_such_package_here.mod", "X", hint="install no-such-package"))
    with pytest.raises(ImportError, match="backend 'gone' needs a package.*install no-such"):
        reg.get("gone")


def test_unknown_transfer_backend_keeps_its_error_type():
    with pytest.raises(BackendUnavailableError, match="unknown transfer backend 'x'"):
        TRANSFER_BACKENDS.get("x")


def test_the_simulator_the_router_and_the_config_share_policy_names():
    assert COLOCATED_POLICIES == ROUTING_POLICIES.names()
    assert set(get_args(RoutingPolicyName)) <= set(ROUTING_POLICIES.names())
    assert isinstance(make_routing_policy("power-of-two"), PowerOfTwoChoices)
    with pytest.raises(ValueError, match="unknown routing policy 'p2c'; choose one of"):
        make_routing_policy("p2c")
    assert POLICIES == ORDERINGS.names() == ("fcfs", "edf", "lrs", "ilrs")
