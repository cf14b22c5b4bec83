"""``python -m placement plan``: MegaScale-Infer's deployment-plan search from the command
line, optionally writing the plan as a Serve config YAML (``serve run FILE``).

Examples::

    python -m placement plan --model mixtral-8x22b --gpus H20,L40S --heterogeneous
    python -m placement plan --model PATH/TO/MOE --gpus CPU --gpus-per-node 1 --max-gpus 5 \\
        --tpot-slo 0.5 --avg-context 64 --out moe_plan.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from placement.gpus import get_gpu
from placement.model_specs import MODELS, ModelSpec, get_model
from placement.moe_plan import Hardware, Workload, search_plan
from placement.serve_plan import decode_context, describe, model_spec_from_hf, serve_args


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


def _model(arg: str) -> tuple[ModelSpec, str | None]:
    """A spec by name, or one read from a model folder (then also the folder)."""
    if arg.lower() in MODELS:
        return get_model(arg), None
    path = Path(arg)
    if not (path / "config.json").is_file():
        raise SystemExit(
            f"--model {arg!r} is neither a known spec ({', '.join(MODELS)}) nor a folder "
            "with a config.json"
        )
    raw = json.loads((path / "config.json").read_text())
    return model_spec_from_hf(raw, path.name), str(path.resolve())


def _avg_context(args: argparse.Namespace) -> float:
    if args.avg_context is not None:
        return float(args.avg_context)
    if args.trace is None:
        raise SystemExit("give --avg-context TOKENS or --trace NAME|FILE")
    from sim.traces import load_trace  # the CLI only; the planner itself reads no files

    try:
        requests = load_trace(args.trace, args.trace_dir, limit=args.trace_limit)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None
    return decode_context((r.input_len, r.output_len) for r in requests)


def plan_command(args: argparse.Namespace) -> int:
    model, folder = _model(args.model)
    if not model.is_moe:
        raise SystemExit(f"{model.name} is dense: the MoE plan search needs a MoE model")
    attention = _hardware(args.gpus, args)
    experts = _hardware(args.expert_gpus or args.gpus, args) if args.heterogeneous else None
    workload = Workload(avg_context=_avg_context(args), tpot_slo_s=args.tpot_slo)
    try:
        micro = [int(m) for m in args.micro_batches.split(",")]
    except ValueError:
        raise SystemExit(f"--micro-batches takes e.g. 3,4, got {args.micro_batches!r}") from None
    try:
        plan = search_plan(model, attention, experts, workload, micro, max_gpus=args.max_gpus)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    lines = describe(plan, workload)
    print("\n".join(lines))
    if args.out:
        import yaml

        try:
            app_args = serve_args(plan, folder, args.model_name or model.name)
        except ValueError as e:
            raise SystemExit(str(e)) from None
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
        header = "".join(f"# {line}\n" for line in ["Written by python -m placement plan", *lines])
        Path(args.out).write_text(header + yaml.safe_dump(config, sort_keys=False))
        print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m placement")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="MoE attention/expert deployment plan (MegaScale-Infer)")
    p.add_argument("--model", required=True, help="a spec name or a Hugging Face model folder")
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
    p.add_argument("--avg-context", type=float, help="mean KV tokens of a decoding request")
    p.add_argument("--trace", help="a trace name or file instead of --avg-context")
    p.add_argument("--trace-dir", help="where trace files live (default: the shared traces)")
    p.add_argument("--trace-limit", type=int, default=None, help="first N requests only")
    p.add_argument("--micro-batches", default="3,4", help="m values to try")
    p.add_argument("--out", help="write a Serve config YAML here")
    p.add_argument("--model-name", help="the model id clients send (default: the spec name)")
    p.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    return plan_command(args)


if __name__ == "__main__":
    sys.exit(main())
