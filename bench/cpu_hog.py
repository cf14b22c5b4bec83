"""The co-located load of issue 25: one CPU-bound process (a Python busy loop) at nice 0
while a block runs, so a bench measures the server beside a busy neighbour."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def cpu_hog() -> Iterator[None]:
    hog = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, 0),
        start_new_session=True,  # not in the bench client's session (client_session.py)
    )
    try:
        yield
    finally:
        hog.kill()
        hog.wait()
