"""The README's fenced code blocks, for tests that run them as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def fenced_blocks() -> list[tuple[str, str]]:
    """Every fenced block of the README in order, as (language, text)."""
    return _FENCE.findall(README.read_text(encoding="utf-8"))


def readme_block(lang: str, containing: str) -> str:
    """The one ``lang`` block of the README whose text contains ``containing``."""
    found = [body for kind, body in fenced_blocks() if kind == lang and containing in body]
    assert len(found) == 1, f"{len(found)} {lang} blocks of the README contain {containing!r}"
    return found[0]
