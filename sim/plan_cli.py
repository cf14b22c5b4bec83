"""``python -m sim plan``: a deployment plan from the command line, optionally written as a
Serve config YAML (``serve run FILE``). It lives with the simulator because it replays a
trace on the plan (``placement`` imports no simulator).

A MoE model gets MegaScale-Infer's attention/expert plan (``placement.moe_plan``); a dense
model gets the cheapest colocated ``tp x spp x kvp`` group or P/D group for a trace's load
(``placement.dense_plan``). With ``--trace`` the simulator replays the trace on the plan
(``sim.plan_replay``) and says whether the SLOs hold; that line is printed and written into
the YAML as a comment, with the plan's other facts.

Examples::

    python -m sim plan --model mixtral-8x22b --gpus H20,L40S --heterogeneous
    python -m sim plan --model tiny-moe --gpus CPU --gpus-per-node 1 --max-gpus 5 \\
        --tpot-slo 0.5 --trace requests.jsonl --out moe_plan.yaml
    python -m sim plan --model llama3-70b --gpus A100,H100 --trace conversation \\
        --ttft-slo 10 --tpot-slo 0.1 --out dense_plan.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from placement.dense_plan import DenseSLO, search_dense_plan, trace_stats
from placement.gpus import get_gpu
from placement.model_specs import MODELS, ModelSpec, get_model
from placement.moe_plan import Hardware, Workload, search_plan
from placement.serve_plan import (
    decode_context,
    dense_serve_args,
    describe,
    describe_dense,
    model_spec_from_hf,
    serve_args,
)

if TYPE_CHECKING:
    from sim.workload import TraceRequest


def _pairs(values: list[str], flag: str) -> dict[str, float]:
    out = {}
    for item in values:
        name, sep, value = item.partition("=")
        try:
            out[get_gpu(name).name] = float(value)
        except ValueError:
            raise SystemExit(f"{flag} takes GPU=NUMBER, got {item!r}") from None
        if not sep:
            raise SystemExit(f"{flag} takes GPU=NUMBER, got {item!r}")
    return out


def _hardware(names: str, args: argparse.Namespace) -> list[Hardware]:
    prices, nics = _pairs(args.price, "--price"), _pairs(args.nic_bw, "--nic-bw")
    out = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        try:
            gpu = get_gpu(name)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if gpu.name in prices:
            gpu = dataclasses.replace(gpu, price=prices[gpu.name])
        hw = Hardware.named(gpu.name, nics.get(gpu.name), args.gpus_per_node)
        out.append(dataclasses.replace(hw, gpu=gpu))
    if not out:
        raise SystemExit("--gpus names no GPU")
    return out


# Bundled models: name -> (tiny model kind, the YAML's ``model``: None is the built-in
# dense tiny model the runtime loads by default, else the written folder).
BUNDLED = {"tiny-dense": "dense", "tiny-moe": "moe"}


def _model(arg: str) -> tuple[ModelSpec, str | None, str]:
    """A spec by name, a bundled tiny model, or one read from a model folder; with the
    folder the YAML names (None: the runtime's built-in model) and the default id."""
    if arg.lower() in BUNDLED:
        from models import tiny_model_dir  # writes the bundled model once into the cache

        kind = BUNDLED[arg.lower()]
        path = tiny_model_dir(kind)
        raw = json.loads((path / "config.json").read_text())
        folder = None if kind == "dense" else str(path.resolve())
        name = "meridian-tiny" if kind == "dense" else "meridian-tiny-moe"
        return model_spec_from_hf(raw, arg.lower()), folder, name
    if arg.lower() in MODELS:
        spec = get_model(arg)
        return spec, None, spec.name
    path = Path(arg)
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"--model {arg!r} is neither a known spec ({', '.join(MODELS)}), a bundled model "
            f"({', '.join(BUNDLED)}) nor a folder with a config.json"
        )
    raw = json.loads((path / "config.json").read_text())
    spec = model_spec_from_hf(raw, path.name)
    return spec, str(path.resolve()), spec.name


def _trace(args: argparse.Namespace) -> list[TraceRequest] | None:
    if args.trace is None:
        return None
    from sim.traces import load_trace  # the CLI only; the planner itself reads no files

    try:
        requests = load_trace(args.trace, args.trace_dir, limit=args.trace_limit)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None
    if not requests:
        raise SystemExit(f"trace {args.trace!r} holds no requests")
    return requests


def _avg_context(args: argparse.Namespace, requests: list[TraceRequest] | None) -> float:
    if args.avg_context is not None:
        return float(args.avg_context)
    if requests is None:
        raise SystemExit("give --avg-context TOKENS or --trace NAME|FILE")
    return decode_context((r.input_len, r.output_len) for r in requests)


def _moe_plan(
    args: argparse.Namespace,
    model: ModelSpec,
    folder: str | None,
    name: str,
    requests: list[TraceRequest] | None,
) -> tuple[list[str], dict[str, Any]]:
    attention = _hardware(args.gpus, args)
    experts = _hardware(args.expert_gpus or args.gpus, args) if args.heterogeneous else None
    workload = Workload(avg_context=_avg_context(args, requests), tpot_slo_s=args.tpot_slo)
    try:
        micro = [int(m) for m in args.micro_batches.split(",")]
    except ValueError:
        raise SystemExit(f"--micro-batches takes e.g. 3,4, got {args.micro_batches!r}") from None
    try:
        plan = search_plan(model, attention, experts, workload, micro, max_gpus=args.max_gpus)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    lines = describe(plan, workload)
    replicas = 1
    if requests is not None:
        from sim.plan_replay import moe_cluster, moe_replicas, replay

        replicas = moe_replicas(plan, requests)
        if args.max_gpus is not None:
            replicas = max(1, min(replicas, args.max_gpus // plan.gpus))
        lines.append(f"replicas for the trace's decode load: {replicas}")
        hw_a = next(h for h in attention if h.gpu.name == plan.gpu_a)
        hw_e = next(h for h in (experts or attention) if h.gpu.name == plan.gpu_e)
        cluster = moe_cluster(plan, model, hw_a, hw_e, replicas)
        lines.append(
            replay(cluster, requests, args.ttft_slo, args.tpot_slo, args.slo_target).line()
        )
    else:
        lines.append("no --trace: no simulated replay")
    if not args.out:
        return lines, {}
    try:
        return lines, serve_args(plan, folder, args.model_name or name, replicas=replicas)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _dense_plan(
    args: argparse.Namespace,
    model: ModelSpec,
    folder: str | None,
    name: str,
    requests: list[TraceRequest] | None,
) -> tuple[list[str], dict[str, Any]]:
    if requests is None:
        raise SystemExit(f"{model.name} is dense: its plan needs --trace NAME|FILE (the load)")
    if args.heterogeneous:
        raise SystemExit("--heterogeneous is for MoE models (attention and expert GPUs)")
    from sim.plan_replay import dense_cluster, replay

    hardware = _hardware(args.gpus, args)
    stats = trace_stats((r.arrival, r.input_len, r.output_len) for r in requests)
    try:
        slo = DenseSLO(args.ttft_slo, args.tpot_slo, target=args.slo_target)
    except ValueError as e:
        raise SystemExit(f"--ttft-slo, --tpot-slo, --slo-target: {e}") from None
    modes = [m.strip() for m in args.dense_modes.split(",") if m.strip()]
    if not modes or not set(modes) <= {"colocated", "pd"}:
        raise SystemExit(f"--dense-modes takes colocated, pd or both, got {args.dense_modes!r}")
    try:
        plan = search_dense_plan(model, hardware, stats, slo, modes)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.max_gpus is not None and plan.gpus > args.max_gpus:
        raise SystemExit(
            f"the cheapest plan meeting the SLOs needs {plan.gpus} GPUs, more than --max-gpus "
            f"{args.max_gpus}: raise --max-gpus or the SLOs, or replay a slower trace"
        )
    lines = describe_dense(plan, slo, stats.rate)
    hw = next(h for h in hardware if h.gpu.name == plan.gpu)
    cluster = dense_cluster(plan, model, hw, slo.ttft_s, slo.tpot_s)
    lines.append(replay(cluster, requests, slo.ttft_s, slo.tpot_s, args.slo_target).line())
    return lines, dense_serve_args(plan, folder, args.model_name or name, slo)


def plan_command(args: argparse.Namespace) -> int:
    model, folder, name = _model(args.model)
    requests = _trace(args)
    if model.is_moe:
        lines, app_args = _moe_plan(args, model, folder, name, requests)
    else:
        lines, app_args = _dense_plan(args, model, folder, name, requests)
    if args.out and args.model.lower() in MODELS:
        lines.append(f"{model.name} is a spec without weights: set args.model to its folder")
    print("\n".join(lines))
    if args.out:
        import yaml

        config = {
            "proxy_location": "EveryNode",
            "http_options": {"host": "127.0.0.1", "port": args.port},
            "applications": [
                {
                    "name": "meridian",
                    "route_prefix": "/",
                    "import_path": "serve_app:build_app",
                    "args": app_args,
                }
            ],
        }
        header = "".join(f"# {line}\n" for line in ["Written by python -m sim plan", *lines])
        Path(args.out).write_text(header + yaml.safe_dump(config, sort_keys=False))
        print(f"wrote {args.out}")
    return 0


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's arguments (``python -m sim plan``)."""
    p.add_argument(
        "--model", required=True, help="a spec name, tiny-moe / tiny-dense, or a model folder"
    )
    p.add_argument("--gpus", default="A800", help="GPU types, comma-separated")
    p.add_argument(
        "--heterogeneous", action="store_true", help="try every (attention, expert) GPU pair"
    )
    p.add_argument("--expert-gpus", help="GPU types for experts (with --heterogeneous)")
    p.add_argument("--price", action="append", default=[], help="GPU=RELATIVE_PRICE")
    p.add_argument("--nic-bw", action="append", default=[], help="GPU=BYTES_PER_S per GPU")
    p.add_argument("--gpus-per-node", type=int, default=8, help="most GPUs of a TP group")
    p.add_argument("--max-gpus", type=int, help="most GPUs the plan may use")
    p.add_argument("--tpot-slo", type=float, default=0.150, help="seconds")
    p.add_argument("--ttft-slo", type=float, default=30.0, help="seconds (the replay; dense)")
    p.add_argument(
        "--slo-target", type=float, default=0.9, help="share of requests the SLOs must hold for"
    )
    p.add_argument("--avg-context", type=float, help="mean KV tokens of a decoding request")
    p.add_argument(
        "--trace", help="a trace name or file: the load (dense), the mean context, the replay"
    )
    p.add_argument("--trace-dir", help="where trace files live (default: the shared traces)")
    p.add_argument("--trace-limit", type=int, default=None, help="first N requests only")
    p.add_argument("--micro-batches", default="3,4", help="m values to try")
    p.add_argument(
        "--dense-modes", default="colocated,pd", help="dense groups to consider: colocated, pd"
    )
    p.add_argument("--out", help="write a Serve config YAML here")
    p.add_argument("--model-name", help="the model id clients send (default: the spec name)")
    p.add_argument("--port", type=int, default=8000)
