#!/usr/bin/env python
"""The field tables of docs/configuration.md, generated from `hicache_cp.config.Config`.

    python tools/config_doc.py            # rewrite the tables in docs/configuration.md
    python tools/config_doc.py --check    # exit 1 when the page is out of date

Each field's type and default come from the dataclasses (`Config`, `L3Config`);
its meaning and the replay's named flag come from `MEANING` below, which must
name every field (tests/test_docs.py runs `--check` and checks every flag named
here exists in `hicache-cp replay`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hicache_cp.config import Config  # noqa: E402
from hicache_cp.l3.config import L3Config  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- generated: fields (tools/config_doc.py) -->", "<!-- end generated -->"

#: field -> (meaning, the replay's named flags besides `--set`).
MEANING: dict[str, tuple[str, tuple[str, ...]]] = {
    "model": ("model preset: `tiny` (CPU tests) or `deepseek-v3.2` (61 + 1 layers, MLA fp8 + indexer state)", ("--model",)),
    "model_layout": ("a table of `ModelLayout` fields overriding the preset's (TOML only)", ()),
    "page_size": ("tokens per page", ()),
    "host_budget_bytes": ("L2 bytes per rank, all parts together; `\"auto\"`: what the machine or container gives, "
                          "minus `host_reserve_bytes`, shared by the ranks on the machine, agreed across CP ranks (MIN)",
                          ("--l2-gib", "--l2-fraction")),
    "host_reserve_bytes": ("left to the process and container when the budget is `\"auto\"`", ()),
    "l1_pages": ("L1 capacity in pages (when the library owns L1)", ("--l1-pages",)),
    "l1_free_room": ("free L1 kept after eviction: a fraction (float) or pages (int)", ()),
    "l2_free_room": ("free L2 kept after eviction: a fraction (float) or pages (int)", ()),
    "write_policy": ("`write_through` (per layer, during the forward), `write_through_selective` (after "
                     "`write_threshold` hits), `write_back` (when L1 evicts)", ("--write-policy",)),
    "write_threshold": ("hits before `write_through_selective` backs a node up", ()),
    "l2_exclusive": ("`write_back` only: L1 and L2 hold disjoint pages (docs/design/eviction.md)", ()),
    "eviction_policy": ("`lru`, `hit_weighted` or `reuse_lru` (`hicache_cp.policy`)", ("--policy",)),
    "io_backend": ("`auto` (`direct` on CUDA, `cpu` otherwise), `direct` or `cpu`", ("--io-backend",)),
    "cp_size": ("context-parallel ranks sharing the KV by page", ("--cp-size",)),
    "debug_checks": ("check every invariant after every operation and poison every freed page (slow; tests)", ()),
    "pin_host": ("pin L2 for CUDA copies; unset: when CUDA is available", ()),
    "verify_restores": ("check every restored page against its checksum before it counts: `all`, `sample` (every L3 and PD page, one L2-loaded page in 8) or `off` (docs/integrity.md)", ()),
    "backup_submits_per_forward": ("per model and forward, how many times the layer hooks submit the backups of the layers written so far: fewer cost the forward's thread less, the copies trail the forward by more layers", ()),
    "l3": ("the L3 tier, the `[l3]` table below; off by default", ("--l3",)),
    "pd_timeout_s": ("PD: seconds a transfer room may stay unfinished (rule 9)", ("--pd-timeout-s",)),
    "pd_per_layer": ("PD: send each layer from the forward's layer hooks, not after insert", ("--pd-per-layer",)),
    "node_segment": ("the node tier: L2 in this named shared segment every rank of the node maps, one copy for "
                     "TP replicas, kept across restarts; empty: private pools (docs/node-tier.md)", ("--node-segment",)),
    "node_segment_dir": ("where the segment lives; empty: `/dev/shm`, or a hugetlbfs mount with room", ()),
    "node_sharing": ("`auto` (`replicated` at cp_size 1, `per_rank` under CP), `replicated` or `per_rank`", ()),
    "node_adopt": ("a restarted engine adopts what the segment's journal holds (same layout, `verify_restores` "
                   "not `off`); every adopted page is checked at its first load", ()),
    "node_drop_on_close": ("an orderly close removes the segment (its last user does)", ()),
    "node_numa": ("the segment's NUMA placement: `auto` (interleave over several memory nodes), `interleave`, "
                  "`local`", ()),
    "node_model_id": ("the model's identity in the segment's fingerprint; empty: `model` (the plug-ins set it)", ()),
    # [l3]
    "l3.backend": ("`none` or `mooncake`; `enabled = true` means `mooncake`", ("--l3",)),
    "l3.master": ("the Mooncake master's RPC address, HOST:PORT", ("--l3-master",)),
    "l3.local_hostname": ("this client's address for the store's transfer engine", ()),
    "l3.protocol": ("`tcp`, or `rdma` (with `device_name`) in production", ()),
    "l3.device_name": ("RDMA devices (empty for tcp)", ()),
    "l3.namespace": ("key prefix: deployments sharing a master", ()),
    "l3.kv_dtype": ("part of the layout fingerprint", ()),
    "l3.pages_per_object": ("a run of pages grouped into one object; unset: the pages of 512 tokens",
                            ("--l3-pages-per-object",)),
    "l3.group_parts": ("every part of a rank's pages in one object", ()),
    "l3.write_min_hits": ("write back pages hit at least this often", ()),
    "l3.write_queue_pages": ("bound of the write-back queue in pages (0: a quarter of L2)", ("--l3-write-queue",)),
    "l3.prefetch_wait": ("a request waits for its prefetch (up to `prefetch_timeout_s`); false: never waits",
                         ()),
    "l3.prefetch_min_pages": ("the shortest continuation worth a prefetch", ()),
    "l3.prefetch_timeout_s": ("deadline of one prefetch", ()),
    "l3.lookup_timeout_s": ("deadline of one existence lookup", ()),
    "l3.retry_interval_s": ("store down: probe again after this long", ()),
    "l3.close_timeout_s": ("how long closing waits for the store calls in flight", ()),
    "l3.connect_timeout_s": ("start-up: the master must accept a connection within this", ()),
    "l3.unsafe_hold_s": ("L2 pages of a store call that may leave I/O in flight stay held this long; unset: 0 over "
                         "tcp, 300 s over rdma", ()),
    "l3.segment_bytes": ("memory this client lends the store (0: a pure client)", ("--l3-segment-mib",)),
    "l3.local_buffer_bytes": ("the store client's local transfer buffer", ()),
}


def _type(f: dataclasses.Field[Any]) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    t = {"WritePolicy": "str (enum)", "ModelLayout | None": "table", "L3Config": "table"}.get(t, t)
    return t.replace(" | None", " or unset").replace(" | ", " or ")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        return "off" if f.name == "l3" else "-"
    else:
        return "-"
    if value is None:
        return "unset"
    if hasattr(value, "value"):
        value = value.value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= 1 << 20:
        return f"{value} ({value / 2**20:g} MiB)" if value < 1 << 30 else f"{value} ({value / 2**30:g} GiB)"
    return f'"{value}"' if isinstance(value, str) else str(value)


def _rows(cls: type, prefix: str) -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        meaning, flags = MEANING[key]
        env = "-" if key in ("model_layout", "l3") else f"`HICACHE_{key.replace('.', '_').upper()}`"
        cli = ", ".join(f"`{x}`" for x in ("--set " + key + "=V" if key not in ("model_layout", "l3") else "", *flags) if x)
        out.append(f"| `{f.name}` | {_type(f)} | {_default(f)} | {env} | {cli or '-'} | {meaning} |")
    return out


def render() -> str:
    """The generated block, markers included."""
    missing = [k for k in [f.name for f in dataclasses.fields(Config)] + [f"l3.{n}" for n in L3Config.field_names()]
               if k not in MEANING]  # fmt: skip
    if missing:
        raise SystemExit(f"tools/config_doc.py: no MEANING for {missing}")
    head = "| field | type | default | environment | command line (`hicache-cp replay`) | meaning |\n|---|---|---|---|---|---|"
    return "\n".join([
        BEGIN, "", "### Top-level fields", "", head, *_rows(Config, ""), "",
        "### The `[l3]` table", "", head, *_rows(L3Config, "l3."), "", END,
    ])  # fmt: skip


def updated(text: str) -> str:
    """`text` (the page) with its generated block replaced by `render()`."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render() + text[end:]


def main(argv: list[str]) -> int:
    text = PAGE.read_text()
    new = updated(text)
    if "--check" in argv:
        if new != text:
            print("docs/configuration.md is out of date: run python tools/config_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
