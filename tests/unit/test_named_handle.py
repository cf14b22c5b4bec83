"""``NamedHandle``: a region ingress's handle to another application's deployment travels
as its two names and is looked up only where it is used."""

from __future__ import annotations

import copy
import pickle

import pytest

from actors.serving.region_entry import NamedHandle


def test_pickles_as_its_names_without_looking_anything_up():
    h = NamedHandle("Balancer-us", "meridian")
    back = pickle.loads(pickle.dumps(h))
    assert (back.deployment, back.app) == ("Balancer-us", "meridian")
    assert back._handle is None  # nothing resolved yet: no Serve needed to pass it around
    assert copy.deepcopy(h).deployment == "Balancer-us"


def test_private_names_are_not_forwarded_to_the_handle():
    h = NamedHandle("Router", "meridian")
    with pytest.raises(AttributeError):
        h._private  # noqa: B018
