"""The shipped ``serve_config.yaml`` holds every field of ``ServeConfig``, of its group and
of the group's ``engine`` section, each with its default, except the few lines
``OVERRIDES`` lists, each of which says in its comment that it is not the default. A field
whose default is null (a section such as ``regions`` or a group's ``autoscaling``) may be
shown in a comment instead of a live key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from actors.engine.config import EngineConfig
from actors.serving.config import ReplicaGroupConfig, ServeConfig

FILE = Path(__file__).resolve().parents[2] / "serve_config.yaml"

# (section, field) -> the file's value, where the demo deliberately differs from the default
OVERRIDES: dict[tuple[str, str], Any] = {
    ("top", "model"): "SmolLM2-135M-Instruct",  # a small real model, not the tiny test one
    ("top", "model_name"): "SmolLM2-135M-Instruct",
    ("group", "name"): "main",  # its deployment is Replica-main
    ("engine", "kv_cache_memory"): 256 << 20,  # two replicas' KV in 0.5 GiB, not 2 GiB
}


def _args(text: str) -> dict[str, Any]:
    (app,) = yaml.safe_load(text)["applications"]
    return dict(app["args"])


def _commented_keys(text: str) -> set[str]:
    """The keys that start a comment (``# regions: ...``, ``#   store: {...}``)."""
    comments = (line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    return {m[1] for c in comments if (m := re.match(r"\s*(?:- )?(\w+):", c))}


def _sections(text: str) -> list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """Per section: its live keys, its parsed values and its defaults, by field name."""
    args = _args(text)
    cfg = ServeConfig.parse(args)
    group_raw = args["groups"][0]
    group, plain = cfg.groups[0], ReplicaGroupConfig()
    engine = {f.name: getattr(group.engine, f.name) for f in dataclasses.fields(EngineConfig)}
    engine_defaults = {
        f.name: getattr(EngineConfig(), f.name) for f in dataclasses.fields(EngineConfig)
    }
    return [
        (
            "top",
            args,
            {name: getattr(cfg, name) for name in ServeConfig.model_fields},
            {name: getattr(ServeConfig(), name) for name in ServeConfig.model_fields},
        ),
        (
            "group",
            group_raw,
            {name: getattr(group, name) for name in ReplicaGroupConfig.model_fields},
            {name: getattr(plain, name) for name in ReplicaGroupConfig.model_fields},
        ),
        ("engine", group_raw["engine"], engine, engine_defaults),
    ]


def problems(text: str) -> list[str]:
    """What makes ``text`` (a serve config file) short of every field with its default."""
    found = []
    commented = _commented_keys(text)
    for section, live, values, defaults in _sections(text):
        for name, default in defaults.items():
            if name == "groups" or (section == "group" and name == "engine"):
                continue  # their fields are the next sections
            shown = name in live or (default is None and name in commented)
            if not shown:
                found.append(f"{section}.{name}: missing")
            wanted = OVERRIDES.get((section, name), default)
            if values[name] != wanted:
                found.append(f"{section}.{name}: {values[name]!r}, the default is {default!r}")
    return found


def test_every_field_is_in_the_file_with_its_default():
    assert problems(FILE.read_text()) == []


def test_the_file_has_one_colocated_group():
    args = _args(FILE.read_text())
    assert len(args["groups"]) == 1
    assert not ServeConfig.parse(args).groups[0].disaggregated


def test_each_override_differs_and_says_so():
    text = FILE.read_text()
    lines = text.splitlines()
    for (section, name), value in OVERRIDES.items():
        defaults = {s: d for s, _, _, d in _sections(text)}[section]
        assert defaults[name] != value, (section, name)
        key = re.compile(rf"\s*(- )?{name}: {value}\b")
        at = next(i for i, line in enumerate(lines) if key.match(line))
        note = "\n".join(lines[max(at - 3, 0) : at + 1])  # its line and the comment above
        assert "not the default" in note.lower(), (section, name)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (("session_header: x-session-id", ""), "top.session_header: missing"),
        (("max_num_seqs: 256", "max_num_seqs: 128"), "engine.max_num_seqs: 128"),
        (("pin_cores: true", "pin_cores: false"), "group.pin_cores: False"),
        (("# regions:", "# region balancers:"), "top.regions: missing"),
    ],
)
def test_the_check_finds_a_missing_field_or_a_changed_value(edit, needle):
    text = FILE.read_text()
    old, new = edit
    assert old in text
    assert needle in "\n".join(problems(text.replace(old, new, 1)))
