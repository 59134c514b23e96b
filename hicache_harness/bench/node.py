"""`hicache-cp bench-node`: what the node tier costs and saves, measured on this machine.

    adoption   a restarted engine's open (ADOPT) and tree rebuild, against the journal's
               size: journals of --pages entries (committed in branching prefixes of
               --chain pages), each in its own segment; the journal's commit cost too
    checksum   the CPU throughput of the restore checks' checksum (`hicache_cp.checksum`,
               over DeepSeek-V3.2-shaped pages): what the cpu backend pays per byte a
               rank backs up and per byte it loads, an adopted page's first use included
    prefault   an arena over a segment region that already holds its bytes
               (populate, contents kept) against a fresh private arena's prefault
    ranks      the replay on 1, 2 and 4 ranks of one node: today's private L2 per rank
               against one shared copy: hits, host bytes and D2H bytes per rank (the
               proportional share of resident memory measured from /proc)
    numa       the machine's memory nodes, the policy chosen, where the pages landed
    first hit  (--first-hit-gib G) a DeepSeek-V3.2-layout cache over a G GiB segment serves
               a few prompts and closes; a new cache over the same segment (on --device)
               opens, prefaults and registers it, adopts, and serves one of those prompts:
               the seconds from its construction to that first hit, every byte checked

Prints a table; `--json PATH` writes every number with the commit, the machine
and the command. Every segment it makes is removed before it returns.

    python -m hicache_harness bench-node --json bench/results/node-cpu.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache_cp.presets import PRESETS
from hicache_harness.outputs import write_json
from hicache_harness.provenance import command_line, git_commit, machine
from hicache_cp.node.adopt import adopt
from hicache_cp import checksum
from hicache_cp.node.geometry import NodeGeometry, Sharing
from hicache_cp.node.journal import ROOT, Journal
from hicache_cp.node.segment import NodeSegment
from hicache_cp.allocator import LanePageAllocator
from hicache_cp.radix import RadixTree
from hostmem import numa
from hostmem.segment import drop_segment

GIB = 1 << 30
#: DeepSeek-V3.2 at 64-token pages: one logical page is this many host bytes, so a
#: 64 GiB segment holds 64 GiB // this many pages (the journal size the target is about).
DEEPSEEK_PAGE_BYTES = PRESETS["deepseek-v3.2"].layout(64).bytes_per_page


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, nargs="+", default=[2_000, 22_000, 100_000, 250_000],
                   help="journal sizes (entries) to adopt")  # fmt: skip
    p.add_argument("--chain", type=int, default=32, help="pages a prefix adds before it branches")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sums-mib", type=int, default=256, help="bytes the checksum throughput runs over")
    p.add_argument("--prefault-mib", type=int, default=512, help="segment size of the prefault comparison")
    p.add_argument("--replay-limit", type=int, default=90, help="requests of each rank replay (0: skip them)")
    p.add_argument("--first-hit-gib", type=float, default=0, help="segment size of the first-hit run (0: skip it)")
    p.add_argument("--device", default="cpu", help="L1 of the first-hit run: cpu or cuda (pinned, the direct engine)")
    p.add_argument("--json", type=Path, help="write the results here")


def run(args: argparse.Namespace) -> int:
    tag = f"hicache-cp-bench-{os.getpid()}"
    out: dict[str, Any] = {"commit": git_commit(), "machine": machine(), "command": command_line("bench-node")}
    out["adoption"] = [adoption(n, args.chain, args.repeats, f"{tag}-a{n}") for n in args.pages]
    out["adoption_64gib_deepseek"] = extrapolate(out["adoption"], 64 * GIB // DEEPSEEK_PAGE_BYTES)
    out["first_use"] = checksum_rate(args.sums_mib << 20)
    out["prefault"] = prefault(args.prefault_mib << 20, f"{tag}-p")
    out["numa"] = numa_report(f"{tag}-n")
    if args.replay_limit:
        out["ranks"] = ranks(args.replay_limit, f"{tag}-r")
    if args.first_hit_gib:
        out["first_hit"] = first_hit(args.first_hit_gib, args.device, f"{tag}-f")
    print_table(out)
    if args.json:
        write_json(args.json, out)
    return 0


def adoption(pages: int, chain: int, repeats: int, name: str) -> dict[str, Any]:
    """Fill a journal of `pages` entries, then reopen and adopt it `repeats` times."""
    layout = PRESETS["tiny"].layout(64)  # the journal's cost does not depend on the page's bytes
    g = NodeGeometry(layout, "bench", pages + 1, 1, 1, Sharing.REPLICATED)
    seg = NodeSegment(name, g, session=1, adopt=False)
    try:
        journal = Journal(seg, writer=True)
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        page, prefixes = 1, [(ROOT, np.empty(0, np.int64), 0)]  # (key, tokens, position) to branch from
        while page <= pages:
            key, _, pos = prefixes[rng.integers(len(prefixes))]
            n = min(chain, pages + 1 - page)
            tokens = rng.integers(0, 1 << 17, n * 64, dtype=np.int64)
            last = journal.commit(np.arange(page, page + n), pos, tokens, key)
            prefixes.append((last, tokens, pos + n))
            page += n
        commit_s = time.perf_counter() - t0
    finally:
        seg.close()
    opens, adopts, nodes = [], [], 0
    try:
        for r in range(repeats):
            t0 = time.perf_counter()
            again = NodeSegment(name, g, session=2 + r)
            t1 = time.perf_counter()
            tree, alloc = RadixTree(64), LanePageAllocator(pages + 1)
            result = adopt(Journal(again, writer=False).committed(), tree, alloc, frozenset(p.part for p in layout.parts))
            t2 = time.perf_counter()
            assert result.pages == pages, (result.pages, pages)
            nodes = len(result.nodes)
            again.close()
            opens.append(t1 - t0)
            adopts.append(t2 - t1)
    finally:
        drop_segment(name)
    return {"pages": pages, "nodes": nodes, "chain": chain, "commit_us_per_page": round(commit_s / pages * 1e6, 3),
            "open_s": round(statistics.median(opens), 4), "adopt_s": round(statistics.median(adopts), 4),
            "adopt_us_per_page": round(statistics.median(adopts) / pages * 1e6, 3)}  # fmt: skip


def extrapolate(rows: list[dict[str, Any]], pages: int) -> dict[str, Any]:
    """The adoption of a 64 GiB DeepSeek-V3.2 segment's journal, from the measured per-page cost
    of the nearest size (measured directly when one row has that size)."""
    near = min(rows, key=lambda r: abs(r["pages"] - pages))
    return {"pages": pages, "page_bytes": DEEPSEEK_PAGE_BYTES, "from_row_pages": near["pages"],
            "adopt_s": round(near["adopt_us_per_page"] * pages / 1e6 + near["open_s"], 4)}  # fmt: skip


def checksum_rate(nbytes: int) -> dict[str, Any]:
    """The CPU checksum's GB/s over DeepSeek-V3.2-shaped pages (one thread): every layer
    of every part, as the cpu backend checksums a copy (`checksum.checksums_by_layer`)."""
    layout = PRESETS["deepseek-v3.2"].layout(64)
    n = max(1, nbytes // layout.bytes_per_page)
    rng = np.random.default_rng(1)
    views = {p.part: rng.integers(0, 256, (p.num_slots, n, p.page_bytes), dtype=np.uint8) for p in layout.parts}
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for p in layout.parts:
            checksum.checksums_by_layer(views[p.part].reshape(-1, p.page_bytes), p.part, list(p.layer_ids), n)
        best = min(best, time.perf_counter() - t0)
    return {"pages": n, "bytes": n * layout.bytes_per_page, "gb_per_s": round(n * layout.bytes_per_page / best / 1e9, 3)}


def prefault(nbytes: int, name: str) -> dict[str, Any]:
    """Seconds per GiB to make an arena usable: over a segment region that holds its bytes
    already (a restart) and over fresh private memory."""
    from hostmem.arena import HostArena
    from hostmem.segment import Segment

    seg = Segment.open_mapped(name, nbytes)
    try:
        np.frombuffer(seg.mm, np.uint8)[:: 4096] = 1  # type: ignore[arg-type] - every page present, as after a run
        t0 = time.perf_counter()
        HostArena(nbytes, pin=False, memory=seg.region(0, nbytes), background=False, name="kept").close()
        kept = time.perf_counter() - t0
    finally:
        seg.close(unlink_if_last=True)
    t0 = time.perf_counter()
    HostArena(nbytes, pin=False, background=False, name="fresh").close()
    fresh = time.perf_counter() - t0
    return {"bytes": nbytes, "kept_s_per_gib": round(kept * GIB / nbytes, 4), "fresh_s_per_gib": round(fresh * GIB / nbytes, 4)}


def numa_report(name: str) -> dict[str, Any]:
    """The policy `auto` picks here and where a touched segment's pages are."""
    from hostmem.segment import Segment

    seg = Segment.open_mapped(name, 64 << 20)
    try:
        np.frombuffer(seg.mm, np.uint8)[:: 4096] = 1  # type: ignore[arg-type]
        return {"memory_nodes": numa.memory_nodes(), "policy": seg.numa.value,
                "pages_per_node": numa.placement(seg.addr, 64 << 20)}  # fmt: skip
    finally:
        seg.close(unlink_if_last=True)


def ranks(limit: int, name: str) -> list[dict[str, Any]]:
    """The replay on 1, 2 and 4 ranks: private L2 per rank, then one shared copy."""
    from hicache_harness.replay import command as replay

    rows = []
    for n in (1, 2, 4):
        for shared in (False, True):
            argv = ["--limit", str(limit), "--seed", "5", "--device", "cpu", "--node-ranks", str(n)]
            if shared:
                argv += ["--node-segment", f"{name}{n}", "--set", "node_drop_on_close=true"]
            p = argparse.ArgumentParser()
            replay.add_arguments(p)
            rep = replay.replay(p.parse_args(argv))
            per = rep.get("per_rank") or [rep]
            rows.append({
                "ranks": n, "tier": "node" if shared else "private", "hit_rate": round(rep["hit_rate"], 6),
                "mismatches": rep["integrity_mismatches"], "checked_units": rep["integrity_checked_units"],
                "host_bytes_per_rank": [p["host_bytes"] for p in per],
                "host_pss_bytes_per_rank": [p["host_pss_bytes"] for p in per],
                "d2h_bytes_per_rank": [p["bytes_d2h"] for p in per], "wall_s": rep["wall_s"],
            })  # fmt: skip
    return rows


def first_hit(gib: float, device: str, name: str, prompts: int = 4, pages: int = 32) -> dict[str, Any]:
    """Seconds from a restarted cache's construction to its first hit on a `gib` GiB segment."""
    from hicache_cp.cache import HiCache
    from hicache_cp.config import Config
    from hicache_harness.engines.synthetic import ReferenceServer

    cuda = device.startswith("cuda")
    config = Config(model="deepseek-v3.2", page_size=64, host_budget_bytes=int(gib * GIB), l1_pages=2 * pages + 2,
                    io_backend="auto" if cuda else "cpu", pin_host=cuda, node_segment=name,
                    l1_free_room=0, l2_free_room=0)  # fmt: skip
    rng = np.random.default_rng(2)
    tokens = [rng.integers(0, 1 << 17, pages * 64, dtype=np.int64) for _ in range(prompts)]
    try:
        t0 = time.perf_counter()
        first = HiCache(config, device=device)
        built = time.perf_counter() - t0
        server = ReferenceServer(first)
        for i, t in enumerate(tokens):
            server.serve(i, t)
        first.drain()
        first.close()
        t0 = time.perf_counter()
        again = HiCache(config, device=device)
        t1 = time.perf_counter()
        server = ReferenceServer(again)
        result = server.serve(0, tokens[0])
        if cuda:
            import torch

            torch.cuda.synchronize()
        t2 = time.perf_counter()
        stats = again.stats()
        again.close()
    finally:
        drop_segment(name)
    t = server.integrity
    return {"gib": gib, "device": device, "pinned": cuda, "segment_bytes": stats["node_segment_bytes"],
            "fresh_construction_s": round(built, 3), "construction_s": round(t1 - t0, 3),
            "open_s": stats["node_open_s"], "adopt_s": stats["node_adopt_s"],
            "first_request_s": round(t2 - t1, 3), "first_hit_s": round(t2 - t0, 3),
            "hit_pages": result.l2_hit_pages, "adopted_pages": stats["node_adopted_pages"],
            "checked_units": t.checked_units, "expected_units": t.expected_units, "mismatches": t.mismatches}  # fmt: skip


def print_table(out: dict[str, Any]) -> None:
    print("adoption (journal entries -> open + rebuild; median)")
    for r in out["adoption"]:
        print(f"  {r['pages']:>8} pages {r['nodes']:>6} nodes  open {r['open_s']:.4f} s  adopt {r['adopt_s']:.4f} s "
              f"({r['adopt_us_per_page']:.2f} us/page)  commit {r['commit_us_per_page']:.2f} us/page")  # fmt: skip
    e = out["adoption_64gib_deepseek"]
    print(f"  64 GiB DeepSeek-V3.2 segment: {e['pages']} pages -> {e['adopt_s']:.3f} s (from the {e['from_row_pages']} row)")
    f = out["first_use"]
    print(f"checksum (every page backed up or loaded, first use included): {f['gb_per_s']:.2f} GB/s on one thread")
    pf = out["prefault"]
    print(f"prefault per GiB: kept bytes {pf['kept_s_per_gib']:.3f} s, fresh {pf['fresh_s_per_gib']:.3f} s")
    nm = out["numa"]
    print(f"numa: memory nodes {nm['memory_nodes']}, policy {nm['policy']}, pages per node {nm['pages_per_node']}")
    if "first_hit" in out:
        f = out["first_hit"]
        print(f"first hit after a restart on a {f['gib']} GiB segment ({f['device']}): {f['first_hit_s']:.2f} s "
              f"(construction {f['construction_s']:.2f} s, of which adopt {f['adopt_s']:.3f} s; first request "
              f"{f['first_request_s']:.2f} s; {f['hit_pages']} pages hit, {f['mismatches']} mismatches)")  # fmt: skip
    for r in out.get("ranks", []):
        print(f"  {r['ranks']} rank(s) {r['tier']:>7}: hit {r['hit_rate']:.4f}, host B/rank {r['host_bytes_per_rank']}, "
              f"PSS/rank {r['host_pss_bytes_per_rank']}, D2H/rank {r['d2h_bytes_per_rank']}, mismatches {r['mismatches']}")  # fmt: skip
