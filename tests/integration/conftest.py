"""Shared helpers of the integration tests: a private local Ray cluster per test module.

``LocalRayCluster`` starts ``ray start --head --block`` in its own process group on free
ports and a fresh temp dir, so it never collides with another cluster on the machine, and
``stop`` kills exactly that process group (never ``ray stop``, which would stop every
cluster of the user).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray_start
import torch

REPO = Path(__file__).resolve().parents[2]

# One auth mode for every Ray session of the test process: a driver keeps the token state of
# its first ``ray.init``, and actors of a later session with another mode never start.
os.environ["RAY_AUTH_MODE"] = "disabled"  # private 127.0.0.1 clusters only
BIN = Path(sys.executable).parent  # the venv's bin: ray, serve, python
ray_start.install()  # a node that times out at start-up is started once more (its doc)


_handed_out: set[int] = set()
PORT_TAKEN = "Failed to start the grpc server"  # how a head whose GCS port was taken exits


def free_port() -> int:
    """A port free now and never returned before in this process: the OS may hand the same
    ephemeral port to two binds in a row, and ``ray start`` refuses one port given to two
    of its components."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def kill_group(proc: subprocess.Popen, first: int = signal.SIGTERM, grace: float = 20) -> None:
    """Signal ``proc``'s whole process group, then SIGKILL whatever is left after grace."""
    try:
        os.killpg(proc.pid, first)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


class LocalRayCluster:
    BIN = BIN
    REPO = REPO
    free_port = staticmethod(free_port)
    kill_group = staticmethod(kill_group)

    def __init__(
        self, dashboard: bool = False, num_cpus: int = 4, env: dict[str, str] | None = None
    ) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="mer-ray-"))
        self.env = dict(os.environ)
        self.env["PATH"] = f"{BIN}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["PYTHONPATH"] = str(REPO)
        self.env["RAY_AUTH_MODE"] = "disabled"  # a private 127.0.0.1 cluster: no tokens
        self.env.update(env or {})  # what the cluster's processes see, e.g. Serve options
        # A port free when chosen can be taken before Ray binds it (any outgoing connection
        # may get it as its ephemeral port): then the head exits at once, saying so, and is
        # started once more on other ports. Any other failure is raised as it is.
        for attempt in range(3):
            try:
                self._start(dashboard, num_cpus)
                return
            except BaseException as e:
                shutil.rmtree(self.tmp, ignore_errors=True)
                if PORT_TAKEN not in str(e) or attempt == 2:
                    raise
                print(f"ray start: port {self.gcs_port} was taken; other ports", file=sys.stderr)
                self.tmp.mkdir()

    def _start(self, dashboard: bool, num_cpus: int) -> None:
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.env["RAY_ADDRESS"] = self.address
        cmd = [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={self.gcs_port}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            f"--temp-dir={self.tmp}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--include-dashboard={'true' if dashboard else 'false'}",
            f"--dashboard-port={self.dashboard_port}",
            "--disable-usage-stats",
        ]
        self.log = open(self.tmp / "head.log", "wb")
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_ready(dashboard)
        except BaseException:
            kill_group(self.proc, signal.SIGKILL, grace=0)
            self.log.close()
            raise

    def _wait_ready(self, dashboard: bool, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        url = self.dashboard_url + "/api/version" if dashboard else None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited: {(self.tmp / 'head.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.gcs_port), timeout=1):
                    pass
                if url is None:
                    return
                import httpx

                if httpx.get(url, timeout=2).status_code < 500:  # 401: token auth is on
                    return
            except Exception:  # not listening yet
                pass
            time.sleep(0.5)
        raise TimeoutError("the local Ray head did not come up")

    def popen(self, cmd: list[str], log_name: str) -> subprocess.Popen:
        """A process in its own group, with this cluster's environment."""
        log = open(self.tmp / log_name, "wb")
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def connect(self) -> None:
        """``ray.init`` this process as a driver of the cluster."""
        import ray

        os.environ["RAY_AUTH_MODE"] = self.env["RAY_AUTH_MODE"]
        ray.init(address=self.address, log_to_driver=False)

    def stop(self) -> None:
        # ``ray start --block`` takes ~20 s to wind down on SIGTERM; the tests need nothing
        # from a graceful stop (the session folder is removed below): SIGKILL at once. The
        # workers, in groups of their own, exit when their raylet dies.
        kill_group(self.proc, signal.SIGKILL, grace=0)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Reference outputs are computed in this process while a cluster's workers wait on
    their channels (they poll). With two intra-op threads on two cores, every OpenMP barrier
    waits for a thread the scheduler has parked behind a poller: a reference generation took
    14-43 s instead of under 1 s. One thread keeps it at its solo speed; the unit tests after
    these modules get their threads back. Module scope and autouse: set before the module's
    own fixtures (its cluster, its references)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def local_ray_cluster():
    """The ``LocalRayCluster`` class (each module starts and stops its own)."""
    return LocalRayCluster


@pytest.fixture(scope="module")
def connected_ray_cluster():
    """A private local cluster (no dashboard) that this process is connected to, for the
    module's tests; stopped after them."""
    import ray

    cluster = LocalRayCluster(dashboard=False)
    try:
        cluster.connect()
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()
