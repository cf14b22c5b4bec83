"""The server as a new user starts it, for ``bench/serve.py --defaults``: the README's first
command (``make serve``: the environment its Makefile recipe sets, then ``serve run
CONFIG``) on a config holding only ``model`` and one group named ``main``; nothing else
(no core pinning, no token budget, no Ray system config).

Two things differ from a user's shell, neither of them a setting of the server: the config
file names a free HTTP port (other work on this machine may hold 8000), and ``RAY_TMPDIR``
points at a private folder, so ``serve run`` starts its own Ray cluster rather than joining
one that another process started, and stopping it stops only what it started.

``bench/cpu_hog.py`` is the co-located load of issue 25: one CPU-bound process at nice 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.app_probe import free_port, served_model, wait_for
from bench.local_serve import DIRECT_MAX, DIRECT_MIN, DIRECT_SPAN
from bench.serve_http import HttpClient, http_side, median_rate, paired_ratio, run_with_peer
from bench.serve_profile import SERVING, VLLM_SERVER, CpuProfile
from bench.session import exited, start_session, stop_leftovers, stop_session, with_peer

ROOT = Path(__file__).resolve().parent.parent


def make_serve_env(makefile: Path = ROOT / "Makefile") -> dict[str, str]:
    """The ``VAR=value`` words before ``serve run`` in the Makefile's ``serve`` recipe."""
    lines = makefile.read_text().replace("\\\n", " ").splitlines()  # continuations joined
    start = lines.index("serve: $(STAMP)")
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        words = shlex.split(line.strip())
        if "run" in words and any(w.endswith("/serve") for w in words):
            env = {}
            for word in words:
                if "=" not in word or word.startswith("-"):
                    break
                key, _, value = word.partition("=")
                env[key] = value
            return env
    raise ValueError(f"{makefile}: no `serve run` line in the serve recipe")


def defaults_yaml(model: str, port: int, group: str = "{name: main}") -> str:
    """A Ray Serve config file as ``serve_config.yaml``'s, with only model and one group
    (``group``: a YAML flow mapping)."""
    return (
        "proxy_location: EveryNode\n"
        f"http_options: {{host: 127.0.0.1, port: {port}}}\n"
        "applications:\n"
        "  - name: meridian\n"
        "    route_prefix: /\n"
        "    import_path: serve_app:build_app\n"
        "    args:\n"
        f"      model: {model}\n"
        f"      groups: [{group}]\n"
    )


@contextlib.contextmanager
def serve_run(model: str, group: str = "{name: main}") -> Iterator[tuple[str, str, int]]:
    """``serve run`` in its own session on a defaults config; yields (URL, model id, its
    pid) once the app answers, then stops it (SIGINT, as Ctrl-C; then the whole session). Its folder
    (config, log, Ray's files) is removed after a clean run and kept after a failure."""
    tmp = Path(tempfile.mkdtemp(prefix="mrd-", dir="/tmp"))  # short: Ray's socket paths
    port = free_port()
    config, log = tmp / "config.yaml", tmp / "serve.log"
    config.write_text(defaults_yaml(model, port, group))
    env = os.environ | make_serve_env() | {"RAY_TMPDIR": str(tmp / "ray")}
    url_port = port  # Serve's proxy, unless the recipe serves on the ingress replica's own
    if DIRECT_MIN in env:  # port: a free one here, as the Makefile's is this machine's 8000
        url_port = free_port(DIRECT_SPAN)
        env |= {DIRECT_MIN: str(url_port), DIRECT_MAX: str(url_port + DIRECT_SPAN - 1)}
    serve = str(Path(sys.executable).parent / "serve")
    proc = start_session([serve, "run", str(config)], log, env, ROOT)
    url = f"http://127.0.0.1:{url_port}"
    # SIGTERM to the bench unwinds it (SystemExit), so the session below is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    clean = False
    try:
        name = wait_for(
            lambda: served_model(url),
            f"serve run's app did not answer (see {log})",
            900,
            gone=lambda: exited(proc),
            every_s=1.0,
        )
        yield url, name, proc.pid
        clean = True
    finally:
        stop_session(proc)
        stop_leftovers(tmp)
        if clean:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"serve run's log: {log}; its last lines:", file=sys.stderr)
            print(log.read_text()[-3000:], file=sys.stderr)


async def run_defaults(
    args: argparse.Namespace,
    url: str,
    model: str,
    session: int,
    profile: CpuProfile | None = None,
) -> None:
    """``--defaults``: the app as ``serve run`` starts it (in session ``session``), against
    the peer and/or itself beside a CPU hog. Prints whether its req/s ever falls as streams
    rise."""
    client = HttpClient(url, model, args.new_tokens, None, True)
    sides = [http_side("meridian", client)]
    if args.cpu_hog:
        sides.append(http_side("with-hog", client, hog=True))
    # a server at rest takes no CPU from another's runs: each is paused while others run
    sessions = with_peer({side.name: session for side in sides}, "peer", args.peer_url)
    results, peer_ran = await run_with_peer(args, sides, client, profile, sessions)
    rates = [median_rate(results, "meridian", c) for c in args.concurrency]
    rises = all(b >= a for a, b in zip(rates, rates[1:], strict=False))
    steps = " -> ".join(f"{r:.2f}" for r in rates)
    print(f"meridian req/s over {args.concurrency} streams: {steps} (never falls: {rises})")
    last = ""
    if peer_ran:
        vs = [
            f"{paired_ratio(results, 'meridian', 'peer', c):.2f} at {c}" for c in args.concurrency
        ]
        print(f"defaults meridian/peer ({args.peer_model}) req/s: " + ", ".join(vs) + " streams")
        top = max(args.concurrency)
        last = f"defaults meridian/peer at {top} streams: "
        last += f"{paired_ratio(results, 'meridian', 'peer', top):.2f}"
    if args.cpu_hog:
        vs = [
            f"{paired_ratio(results, 'with-hog', 'meridian', c):.2f} at {c}"
            for c in args.concurrency
        ]
        print("req/s with a CPU hog / without: " + ", ".join(vs) + " streams")
        c = 8 if 8 in args.concurrency else max(args.concurrency)
        last = (
            f"cpu-hog/alone at {c} streams: {paired_ratio(results, 'with-hog', 'meridian', c):.2f}"
        )
    if profile and peer_ran:
        c = 8 if 8 in args.concurrency else max(args.concurrency)
        ours = profile.per_token("meridian", c, SERVING)
        theirs = profile.per_token("peer", c, (VLLM_SERVER,))
        print(
            f"CPU ms per output token at {c} streams: Meridian outside its engines {ours:.2f}, "
            f"the peer's API server {theirs:.2f}"
        )
        last = "cpu-ms per output token outside engines meridian/vllm: "
        last += f"{profile.outside_engines_ratio('meridian', 'peer', c):.2f}"
    if last:
        print(last)
