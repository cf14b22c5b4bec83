"""Loaders for the public traces in ``../shared/data/traces`` (see its README).

- Mooncake FAST'25 JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``,
  ``hash_ids`` (512-token prefix blocks).
- Azure LLM inference 2023 CSV: ``TIMESTAMP`` (wall clock), ``ContextTokens``,
  ``GeneratedTokens``; no prefix information.
Arrival times are seconds from the first request; ``speed`` divides them (2.0 = twice as
fast). The trace folder is found relative to the repository root unless given.
"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

from sim.workload import TraceRequest, scale_time

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE_DIR = REPO_ROOT.parent / "shared" / "data" / "traces"

TRACES = {
    "conversation": "conversation_trace.jsonl",
    "synthetic": "synthetic_trace.jsonl",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
}


def trace_path(name: str, trace_dir: str | Path | None = None) -> Path:
    """A trace by short name (``conversation``, ``azure-code`` ...) or by file path."""
    p = Path(name)
    if p.suffix in (".jsonl", ".csv") and p.exists():
        return p
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACES)} or a file path")
    path = Path(trace_dir or DEFAULT_TRACE_DIR) / TRACES[name]
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; pass --trace-dir to say where traces live")
    return path


def load_mooncake(
    path: str | Path, limit: int | None = None, speed: float = 1.0
) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            out.append(
                TraceRequest(
                    request_id=f"r{i}",
                    arrival=row["timestamp"] / 1000.0,
                    input_len=int(row["input_length"]),
                    output_len=max(1, int(row["output_length"])),
                    hash_ids=tuple(row["hash_ids"]),
                )
            )
    return scale_time(out, speed) if speed != 1.0 else out


def load_azure(
    path: str | Path, limit: int | None = None, speed: float = 1.0
) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    t0: datetime | None = None
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if limit is not None and i >= limit:
                break
            # 7 fractional digits: Python parses at most 6.
            stamp = row["TIMESTAMP"].strip()
            if "." in stamp:
                head, frac = stamp.split(".")
                stamp = f"{head}.{frac[:6]}"
            t = datetime.fromisoformat(stamp)
            t0 = t0 or t
            out.append(
                TraceRequest(
                    request_id=f"r{i}",
                    arrival=(t - t0).total_seconds(),
                    input_len=max(1, int(row["ContextTokens"])),
                    output_len=max(1, int(row["GeneratedTokens"])),
                )
            )
    return scale_time(out, speed) if speed != 1.0 else out


def load_trace(
    name: str, trace_dir: str | Path | None = None, limit: int | None = None, speed: float = 1.0
) -> list[TraceRequest]:
    path = trace_path(name, trace_dir)
    loader = load_mooncake if path.suffix == ".jsonl" else load_azure
    return loader(path, limit=limit, speed=speed)
