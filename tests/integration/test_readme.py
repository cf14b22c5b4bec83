"""The README's commands, run as written on this checkout.

- The offline-rollout block (activate the venv, Ray token auth, ``ray start --head``,
  ``ray job submit``, ``ray stop``) runs verbatim in bash inside private user, network, PID
  and mount namespaces (``unshare``): its default ports, ``~/.ray``, ``/tmp`` and ``ray stop``
  (which stops every Ray process its user can see) then touch nothing outside the test, and
  the namespace's end kills whatever is left. Without unprivileged namespaces it is skipped.
- The Python API snippet runs in a fresh interpreter; ``python -m actors.rollout --help`` too.

Not here: the OpenAI client snippet needs a served app (``test_serve_openai.py`` runs it
against its tiny-model server); ``make serve`` / ``make test`` are not run (slow, and ``make
test`` runs this file), but they must stay the README's first commands, and the README a
guide of at most ``MAX_LINES`` lines (the rest lives in docs/).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from readme_common import README, fenced_blocks, readme_block

pytestmark = pytest.mark.timeout(420)

MAX_LINES = 250

REPO = Path(__file__).resolve().parents[2]
NAMESPACES = ["--user", "--map-root-user", "--net", "--pid", "--fork", "--mount-proc"]
# Inside the namespaces: bring up loopback, a private /tmp and HOME (no ~/.ray/auth_token yet,
# as on a fresh machine), then the README's lines from the repository root. The checkout is
# bound back at its own path, so a checkout under /tmp stays visible.
PRELUDE = """set -euo pipefail
ip link set lo up
hold=$(mktemp -d /dev/shm/meridian-readme-XXXXXX)
mount --bind {repo} "$hold"
mount -t tmpfs tmpfs /tmp
mkdir -p {repo}
mount --bind "$hold" {repo}
umount "$hold" && rmdir "$hold"
export HOME=/tmp/home && mkdir -p "$HOME"
cd {repo}
"""


def clean_env() -> dict[str, str]:
    """A new user's shell: no Ray settings of the test process, the venv not active."""
    venv_bin = str(Path(sys.executable).parent)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("RAY_") and k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    }
    path = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != venv_bin]
    env["PATH"] = os.pathsep.join(path)
    # the block's HOME is fresh (no Ray token yet), but the CPU kernels that `make setup`
    # compiled stay in the cache of the user who ran it (kernels/cpu_build.py)
    env.setdefault("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return env


def namespaces_work() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = ["unshare", *NAMESPACES, "sh", "-c", "ip link set lo up && mount -t tmpfs t /tmp"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_isolated(script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        ["unshare", *NAMESPACES, "bash", "-c", script],
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the namespace's init: every process in it dies
        out, _ = proc.communicate()
        pytest.fail(f"the README's commands did not finish in {timeout} s:\n{out[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def test_offline_rollout_block_runs_as_written():
    if not (REPO / ".venv" / "bin" / "activate").exists():
        pytest.skip("the README's block starts from `make setup`'s .venv, which is absent")
    if not namespaces_work():
        pytest.skip("needs unprivileged user/net/pid namespaces (unshare) to run ray start/stop")
    block = readme_block("bash", "ray job submit")
    for command in ("ray start --head", "RAY_AUTH_MODE=token", "ray stop"):
        assert command in block
    result = run_isolated(PRELUDE.format(repo=REPO) + block, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-6000:]
    assert "Generated new authentication token" in out  # a fresh HOME: the block made one
    assert "succeeded" in out
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"id": ')]
    assert sorted(r["id"] for r in records) == ["a", "b"], out[-6000:]
    assert all(r["token_ids"] and r["finish_reason"] in {"stop", "length"} for r in records)
    assert "Stopped all" in out


def run_python(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_python_api_snippet_runs_as_written():
    code = readme_block("python", "from actors import LLM")
    result = run_python(["-c", code])
    assert result.returncode == 0, result.stderr[-6000:]
    assert result.stdout.strip()


def test_rollout_help():
    result = run_python(["-m", "actors.rollout", "--help"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--input" in result.stdout and "--attach" in result.stdout


def test_readme_is_a_short_guide():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_make_serve_and_make_test_come_first():
    lang, body = fenced_blocks()[0]
    commands = [line.split("#")[0].strip() for line in body.splitlines()]
    assert lang == "bash" and commands == ["make serve", "make test"], body


# Every code block of the README, by a line it holds, and the test that runs it.
RUN_BY = {
    ("bash", "make serve"): "test_make_serve_and_make_test_come_first (not run: see above)",
    ("bash", "ray job submit"): "test_offline_rollout_block_runs_as_written",
    ("python", "import openai"): "test_serve_openai.py::test_readme_openai_snippet",
    ("python", "from actors import LLM"): "test_python_api_snippet_runs_as_written",
}


def test_every_code_block_is_run_by_a_test():
    for lang, body in fenced_blocks():
        if lang == "text":  # printed output, not code
            continue
        runners = [
            test for (kind, marker), test in RUN_BY.items() if kind == lang and marker in body
        ]
        assert len(runners) == 1, f"no test runs this README {lang} block:\n{body}"
