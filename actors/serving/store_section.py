"""Which ``store`` options a replica group may set, by kind of group (``ReplicaGroupConfig``
calls these; plain data, no torch, so the ingress may import it).

A colocated group's store (``actors.serving.store_engine``) takes ``dram_bytes``,
``ssd_bytes``, ``ssd_dir``, ``num_shards``, ``placement``, ``tenant_retained_share`` and
``min_load_tokens``; ``read_path`` (other than its default) and ``write_back`` are a
disaggregated group's, and are refused naming the field (a
field at its default passes, so a dumped config reads back). A colocated store also needs
single-worker replicas with prefix caching. ``min_load_tokens`` is a colocated group's
only: a prefill replica loads every stored prefix.
"""

from __future__ import annotations

from typing import Any

PD_ONLY = {
    "read_path": "where a disaggregated group reads a stored prefix (its prefill or decode "
    "replicas); a colocated replica reads it itself",
    "write_back": "decode replicas write their blocks back as they fill; a colocated "
    "replica writes each prompt's blocks after computing them",
}


def check_colocated_store(where: str, store: Any, engine: Any, defaults: Any) -> None:
    """ValueError naming the first field a colocated group's ``store`` section may not
    have; ``engine``: the group's ``EngineConfig``; ``defaults``: a default section."""
    for name, why in PD_ONLY.items():
        if getattr(store, name) != getattr(defaults, name):
            raise ValueError(
                f"{where}: store.{name} is a disaggregated group's option ({why}); remove "
                f"store.{name} or add num_prefill and num_decode"
            )
    layout = {"tp": engine.tp, "spp": engine.spp, "kvp": engine.kvp}
    wide = [f"engine.{k}={v}" for k, v in layout.items() if v != 1]
    if engine.attention_workers:
        wide.append(f"engine.attention_workers={engine.attention_workers}")
    if wide:
        raise ValueError(
            f"{where}: a colocated group's store needs single-worker replicas (tp = spp = "
            f"kvp = 1, no attention/expert workers); remove store or {', '.join(wide)}"
        )
    if not engine.enable_prefix_caching:
        raise ValueError(
            f"{where}: a colocated group's store loads into the prefix cache; remove store "
            "or engine.enable_prefix_caching: false"
        )


def check_pd_store(where: str, store: Any, defaults: Any) -> None:
    """ValueError if a disaggregated group's store sets a colocated group's option (to
    other than its default: a dumped config reads back)."""
    if store.min_load_tokens != defaults.min_load_tokens:
        raise ValueError(
            f"{where}: store.min_load_tokens is a colocated group's option (a prefill "
            "replica loads every stored prefix); remove store.min_load_tokens"
        )
