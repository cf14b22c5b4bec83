"""The three Serve apps ``bench/agents.py`` compares, as ``serve_app.build_app`` configs.

Memory is equal: two engines' worth of ``--kv-cache-mib`` in every setup. Colocated splits
it evenly (two replicas, each serving whole turns); P/D splits it by role
(``--pd-decode-share``, the sides' ``kv_cache_memory``): a prefill replica holds only the
prompts it is prefilling (the store holds the sessions) while the decode replica holds every
turn in flight, prompt plus ``max_tokens``, from placement to its last token.
"""

from __future__ import annotations

import argparse
from typing import Any

MODEL_NAME = "bench"
SETUPS = ("colocated", "pd-prefill", "dualpath")


def app_config(setup: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = {
        "block_size": 16,
        "kv_cache_memory": args.kv_cache_mib << 20,
        "token_budget": 512,
        "max_num_seqs": 64,
    }
    cfg: dict[str, Any] = {
        "model": model_dir,
        "model_name": MODEL_NAME,
        "report_interval_s": 0.1,
        "tool_parser": "hermes",  # the bench model's template shows no tool-call format
    }
    if setup == "colocated":
        cfg["routing"] = "prefix_aware"
        cfg["groups"] = [{"name": "main", "num_replicas": 2, "engine": engine}]
        return cfg
    dual = setup == "dualpath"
    link = {"storage_bytes_per_s": args.storage_mbps * 1e6} if args.storage_mbps else {}
    prefill_kv, decode_kv = pd_kv_split(args)
    cfg["groups"] = [
        {
            "name": "pd",
            "num_replicas": 1,
            "num_prefill": 1,
            "num_decode": 1,
            "prefill": {**link, "kv_cache_memory": prefill_kv},
            "decode": {**link, "kv_cache_memory": decode_kv},
            "engine": engine,
            "store": {
                "dram_bytes": args.store_mib << 20,
                "read_path": "dual" if dual else "prefill",
                "write_back": True,
            },
            "conductor": {"scheduler": "dualpath" if dual else "mooncake"},
        }
    ]
    return cfg


def pd_kv_split(args: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode) KV bytes: two engines of ``--kv-cache-mib`` split by role."""
    total = 2 * (args.kv_cache_mib << 20)
    decode = int(total * args.pd_decode_share) // (1 << 20) << 20  # whole MiB
    return total - decode, decode


def expected_replicas(setup: str) -> int:
    return 2 if setup == "colocated" else 1
