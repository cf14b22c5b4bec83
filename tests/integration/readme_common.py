"""The README's fenced code blocks, for tests that run them as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def fenced_blocks(doc: Path = README) -> list[tuple[str, str]]:
    """Every fenced block of ``doc`` (the README) in order, as (language, text)."""
    return _FENCE.findall(doc.read_text(encoding="utf-8"))


def readme_block(lang: str, containing: str, doc: Path = README) -> str:
    """The one ``lang`` block of ``doc`` (the README) whose text contains ``containing``."""
    found = [body for kind, body in fenced_blocks(doc) if kind == lang and containing in body]
    assert len(found) == 1, f"{len(found)} {lang} blocks of {doc.name} contain {containing!r}"
    return found[0]
