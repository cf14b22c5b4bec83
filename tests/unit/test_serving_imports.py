"""The router's and the ingress's Serve replicas start without loading torch: a killed one
is replaced sooner (importing torch took 1-1.5 s of a replacement's start on this machine),
and they hold less memory. Nor does Serve's build of the app (``serve_app``, which imports
every deployment's class): torch took 4 of its 5 s here. Checked in a fresh interpreter,
which imports these modules and reads a model folder's config and tokenizer as the ingress
does."""

from __future__ import annotations

import subprocess
import sys

from models import tiny_model_dir

PROBE = """
import sys
import actors.serving.ingress, actors.serving.router, serve_app
from models import load_tokenizer, read_model_config
model_dir = sys.argv[1]
load_tokenizer(model_dir)
read_model_config(model_dir)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_router_ingress_and_app_build_modules_and_model_reading_do_not_load_torch():
    model_dir = tiny_model_dir("dense")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
