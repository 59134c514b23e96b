"""What the L1 allocators hand out, in DMA descriptors a copy (issue 28, item 1).

The `direct` backend issues one DMA descriptor per run of pages consecutive
on both sides (device page and host page; `io.runs.coalesce_pairs`), and
both the driver (about half a microsecond each) and the copy engines pay per
descriptor. Our host pool prefers runs (`pools.LanePageAllocator`); the
device pages come from whoever owns L1: the harness's own pool (the same
allocator) or, in an engine, the engine's own allocator. This tool serves
the same requests through both and records, for every copy op the cache
plans (backups D2H, loads H2D), its pages and its descriptors, by wrapping
`CopyEngine.plan` from the outside (nothing is added to the library's path):

    ours     hicache-cp's own L1 (`HiCache` with its `DevicePool`), the cache
             protocol of `bench-overhead` (nothing computed)
    sglang   SGLang 0.5.23's scheduler and its paged token allocator (sorted
             free list), with hicache-cp as its tree cache
             (`harness.sglang.SGLangPrefillServer`, CPU)

    .venv/bin/python tools/alloc_shapes.py --trace ../shared/traces/synthetic_trace.jsonl \\
        --limit 300 --json bench/results/alloc-shapes-cpu.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hicache_cp.harness.outputs import write_json
from hicache_cp.harness.provenance import git_commit, machine
from hicache_cp.harness.trace import TraceRequest, load_trace, request_tokens
from hicache_cp.io.base import Direction
from hicache_cp.io.runs import coalesce_pairs

PAGE = 64


def descriptors(device_pages: np.ndarray, host_pages: np.ndarray) -> int:
    """DMA descriptors of one layer of one op: runs consecutive on both sides."""
    return len(coalesce_pairs(np.asarray(device_pages, np.int64), np.asarray(host_pages, np.int64))[2])


class PlanRecorder:
    """Wraps an engine's `plan`: (direction, pages, descriptors, device-side runs) per op."""

    def __init__(self, engine: Any) -> None:
        self.ops: list[tuple[str, int, int, int]] = []
        inner = engine.plan

        def plan(direction: Direction, device_pages: np.ndarray, host_pages: np.ndarray) -> Any:
            d = np.asarray(device_pages, np.int64)
            runs = 1 + int(np.count_nonzero(np.diff(np.sort(d)) != 1)) if len(d) else 0
            self.ops.append((direction.value, len(d), descriptors(d, host_pages), runs))
            return inner(direction, device_pages, host_pages)

        engine.plan = plan

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for direction in ("d2h", "h2d"):
            rows = [o for o in self.ops if o[0] == direction and o[1]]
            if not rows:
                continue
            pages = np.array([r[1] for r in rows])
            desc = np.array([r[2] for r in rows])
            dev_runs = np.array([r[3] for r in rows])
            out[direction] = {
                "ops": len(rows), "pages_per_op": float(pages.mean()), "descriptors_per_op": float(desc.mean()),
                "descriptors_p50": float(np.percentile(desc, 50)), "descriptors_p90": float(np.percentile(desc, 90)),
                "pages_per_descriptor": float(pages.sum() / desc.sum()), "one_descriptor": float(np.mean(desc == 1)),
                "device_runs_per_op": float(dev_runs.mean()),
            }  # fmt: skip
        return out


def run_ours(requests: list[TraceRequest], tpb: int, l1_pages: int, l2_pages: int) -> dict[str, Any]:
    from hicache_cp.cache import HiCache
    from hicache_cp.config import Config
    from hicache_cp.harness.bench.overhead import Timings, serve

    probe = Config.from_dict({"page_size": PAGE, "l1_pages": l1_pages, "io_backend": "cpu", "pin_host": False})
    config = Config.from_dict({**probe.to_dict(), "host_budget_bytes": (l2_pages + 1) * probe.layout().bytes_per_page})
    with HiCache(config, device="cpu") as cache:
        rec = PlanRecorder(cache.engine)
        for r in requests:
            serve(cache, request_tokens(r, tpb), Timings())
        cache.drain()
    return rec.summary()


def run_sglang(requests: list[TraceRequest], tpb: int, l1_pages: int, l2_pages: int) -> dict[str, Any]:
    from hicache_cp.harness.bench.sglang import _token_bytes
    from hicache_cp.harness.sglang.server import ServerSpec, SGLangPrefillServer

    spec = ServerSpec(backend="hicache-cp", page_size=PAGE, device_pages=l1_pages, check_bytes=False, chunk_tokens=4096,
                      context_len=max(64 * 1024, max(r.input_length for r in requests) * 2))  # fmt: skip
    l2_bytes = (l2_pages + 1) * _token_bytes(spec) * PAGE
    env = {"HICACHE_HOST_BUDGET_BYTES": str(l2_bytes), "HICACHE_IO_BACKEND": "cpu", "HICACHE_PIN_HOST": "false"}
    with tempfile.TemporaryDirectory(prefix="alloc-shapes-") as tmp:
        server = SGLangPrefillServer(spec, Path(tmp), tree_cache_kwargs={"env": env})
        try:
            rec = PlanRecorder(server.tree_cache.cache.engine)
            for i, r in enumerate(requests):
                tokens = request_tokens(r, tpb)
                if len(tokens) < 2:
                    continue
                server.submit(tokens.tolist(), rid=f"q{i}")
                server.run_until_idle()
                server.settle()
        finally:
            server.close()
    return rec.summary()


def table(result: dict[str, Any]) -> str:
    lines = ["| L1 allocator | copy | ops | pages / op | descriptors / op (p50, p90) | pages / descriptor | one descriptor | device runs / op |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, rows in result["engines"].items():
        for d, r in rows.items():
            lines.append(f"| {name} | {d} | {r['ops']} | {r['pages_per_op']:.1f} | {r['descriptors_per_op']:.1f} "
                         f"({r['descriptors_p50']:.0f}, {r['descriptors_p90']:.0f}) | {r['pages_per_descriptor']:.1f} | "
                         f"{r['one_descriptor']:.2f} | {r['device_runs_per_op']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--tokens-per-block", type=int, default=64)
    p.add_argument("--l1-pages", type=int, default=512)
    p.add_argument("--l2-pages", type=int, default=2048)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    requests = load_trace(args.trace)[: args.limit]
    # L1 must hold the longest prompt (SGLang admits nothing larger): raised to 1.25 of it, as bench-sglang does.
    longest = max(len(request_tokens(r, args.tokens_per_block)) for r in requests)
    args.l1_pages = max(args.l1_pages, -(-longest * 5 // 4 // PAGE) + 2)
    shape = (args.tokens_per_block, args.l1_pages, args.l2_pages)
    result = {
        "command": " ".join(["python", *sys.argv]), "commit": git_commit(), "machine": machine(),
        "trace": str(args.trace), "requests": len(requests), "page_size": PAGE, "tokens_per_block": args.tokens_per_block,
        "l1_pages": args.l1_pages, "l2_pages": args.l2_pages,
        "engines": {"ours": run_ours(requests, *shape), "sglang": run_sglang(requests, *shape)},
    }  # fmt: skip
    print(table(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
