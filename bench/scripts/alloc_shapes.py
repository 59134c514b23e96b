"""What the L1 allocators hand out, in DMA descriptors a copy (issue 28, item 1).

The `direct` backend issues one DMA descriptor per run of pages consecutive
on both sides (device page and host page), in the order the op lists them
(`io.runs.dma_plan`: `coalesce_in_order`, then cuts at registration chunks,
which this tool ignores), for every layer of every part. Both the driver
(about half a microsecond each) and the copy engines pay per descriptor. Our
host pool prefers runs (`pools.LanePageAllocator`); the device pages come
from whoever owns L1. This tool serves the same requests through each L1
owner and records every copy op the cache makes (backups D2H, loads H2D):

    replay   `hicache-cp replay` (the synthetic reference server) with
             hicache-cp's own `DevicePool` (`LanePageAllocator`, runs first)
    sglang   SGLang 0.5.23's scheduler functions and its paged token-to-KV
             allocator (a sorted free list), hicache-cp as its tree cache
             (`hicache_harness.sglang.SGLangPrefillServer`, CPU)
    vllm     vLLM 0.33's real `Scheduler` and `BlockPool` (the
             `FreeKVCacheBlockQueue`, LRU order), hicache-cp's connector
             (`tests/test_vllm_bench.py`, CPU)

Per op it records the pages, the descriptors (`descriptors`: runs
consecutive on both sides in the op's order, what `dma_plan` issues per
layer and part), the same after a sort by device page (`coalesce_pairs`:
what sorting an op would find), and the device side alone (`device_runs`).
Nothing is added to the library's path: the recorder wraps
`CopyEngine.plan` (the cache plans each op once) from the outside, or, for
vLLM's worker, which submits layer by layer, `submit_backup`/`submit_load`
on the op's first layer.

Pages: one 512-token trace block is one page in every engine (64 tokens in
ours and SGLang's, 16 in the vLLM bench's tiny model), so every engine sees
the same page counts; L1 and L2 hold the same number of pages in all three.
Requests are served one at a time, each to completion, in trace order;
prefill chunks are 64 pages in SGLang and vLLM (the replay's server has no
chunks).

    .venv/bin/python bench/scripts/alloc_shapes.py --json bench/results/alloc-shapes-cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hicache_harness.outputs import write_json  # noqa: E402
from hicache_harness.provenance import git_commit, machine  # noqa: E402
from hicache_harness.replay import command as replay_command  # noqa: E402
from hicache_harness.replay.setup import load_requests  # noqa: E402
from hicache_harness.trace import TraceRequest, request_tokens  # noqa: E402
from hicache_cp.io.base import CopyEngine, Direction  # noqa: E402
from hicache_cp.io.runs import coalesce_in_order, coalesce_pairs, runs_of  # noqa: E402
from hicache_cp.layout import Part  # noqa: E402

PAGE = 64  # tokens a page in the replay and SGLang (one trace block each)
CHUNK_PAGES = 64  # prefill chunk of SGLang and vLLM, in pages
ENGINES = ("replay", "sglang", "vllm")
TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"


# ---- counting ----------------------------------------------------------------------------------


def descriptors(device_pages: np.ndarray, host_pages: np.ndarray) -> int:
    """DMA descriptors of one layer of one part: runs consecutive on both
    sides in the given order (`dma_plan`'s count, registration chunks aside).

    >>> descriptors(np.array([1, 2, 3]), np.array([7, 8, 9])), descriptors(np.array([1, 2, 3]), np.array([7, 9, 10]))
    (1, 2)
    """
    return len(coalesce_in_order(np.asarray(device_pages, np.int64), np.asarray(host_pages, np.int64))[2])


def sorted_descriptors(device_pages: np.ndarray, host_pages: np.ndarray) -> int:
    """`descriptors` after sorting the pairs by device page (`coalesce_pairs`)."""
    return len(coalesce_pairs(np.asarray(device_pages, np.int64), np.asarray(host_pages, np.int64))[2])


def device_runs(device_pages: np.ndarray) -> int:
    """Runs of consecutive device pages in the given order (the device side alone)."""
    return len(runs_of(np.asarray(device_pages, np.int64))[0]) if len(device_pages) else 0


@dataclass(frozen=True, slots=True)
class OpShape:
    """One copy op: its direction, pages and runs."""

    direction: str
    pages: int
    descriptors: int
    sorted_descriptors: int
    device_runs: int

    @classmethod
    def of(cls, direction: Direction, device_pages: np.ndarray, host_pages: np.ndarray) -> OpShape:
        d, h = np.asarray(device_pages, np.int64), np.asarray(host_pages, np.int64)
        return cls(direction.value, len(d), descriptors(d, h), sorted_descriptors(d, h), device_runs(d))


def _stats(pages: np.ndarray, counts: np.ndarray) -> dict[str, float]:
    return {"per_op": float(counts.mean()), "p50": float(np.percentile(counts, 50)),
            "p90": float(np.percentile(counts, 90)), "pages_per": float(pages.sum() / counts.sum()),
            "one": float(np.mean(counts == 1))}  # fmt: skip


def summarise(ops: list[OpShape]) -> dict[str, Any]:
    """Per direction: ops, pages per op, and for the descriptors (both sides)
    and the device runs alone: mean, p50, p90 per op, pages per one, and the
    fraction of ops that are one. Ops without pages are left out."""
    out: dict[str, Any] = {}
    for direction in (Direction.D2H.value, Direction.H2D.value):
        rows = [o for o in ops if o.direction == direction and o.pages]
        if not rows:
            continue
        pages = np.array([r.pages for r in rows])
        out[direction] = {
            "ops": len(rows), "pages_per_op": float(pages.mean()),
            "descriptors": _stats(pages, np.array([r.descriptors for r in rows])),
            "sorted_descriptors_per_op": float(np.mean([r.sorted_descriptors for r in rows])),
            "device_runs": _stats(pages, np.array([r.device_runs for r in rows])),
        }  # fmt: skip
    return out


# ---- recording (test doubles around the real engines) ------------------------------------------


class Recorder:
    """The shapes of the copy ops of every `CopyEngine` while it is entered.

    `plans()` wraps `CopyEngine.plan` (one call per op: the cache's path);
    `submits()` wraps `submit_backup`/`submit_load` and records an op on its
    first layer of TARGET_KV (vLLM's worker submits each layer and part with
    the op's same page lists). Either restores the class on exit.
    """

    def __init__(self) -> None:
        self.ops: list[OpShape] = []

    @contextlib.contextmanager
    def plans(self) -> Iterator[Recorder]:
        real = CopyEngine.plan

        def plan(engine: CopyEngine, direction: Direction, device_pages: np.ndarray, host_pages: np.ndarray) -> Any:
            self.ops.append(OpShape.of(direction, device_pages, host_pages))
            return real(engine, direction, device_pages, host_pages)

        with _patched(CopyEngine, "plan", plan):
            yield self

    @contextlib.contextmanager
    def submits(self) -> Iterator[Recorder]:
        backup, load = CopyEngine.submit_backup, CopyEngine.submit_load

        def first(part: Part, layer: int) -> bool:
            return part is Part.TARGET_KV and layer == 0

        def submit_backup(engine: CopyEngine, part: Part, layer: int, device_pages: np.ndarray,
                          host_pages: np.ndarray) -> Any:
            if first(part, layer):
                self.ops.append(OpShape.of(Direction.D2H, device_pages, host_pages))
            return backup(engine, part, layer, device_pages, host_pages)

        def submit_load(engine: CopyEngine, part: Part, layer: int, host_pages: np.ndarray,
                        device_pages: np.ndarray) -> Any:
            if first(part, layer):
                self.ops.append(OpShape.of(Direction.H2D, device_pages, host_pages))
            return load(engine, part, layer, host_pages, device_pages)

        with _patched(CopyEngine, "submit_backup", submit_backup), _patched(CopyEngine, "submit_load", submit_load):
            yield self


@contextlib.contextmanager
def _patched(cls: type, name: str, fn: Callable[..., Any]) -> Iterator[None]:
    real = cls.__dict__[name]
    setattr(cls, name, fn)
    try:
        yield
    finally:
        setattr(cls, name, real)


# ---- the engines -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """What every engine shares: the workload and the pool sizes, in pages."""

    trace: Path | None  # None: the embedded default workload
    limit: int
    l1_pages: int
    l2_pages: int

    def replay_argv(self) -> list[str]:
        """`hicache-cp replay`'s flags for this shape (L2 in GiB of the tiny preset's pages)."""
        from hicache_cp.config import Config

        page_bytes = Config.from_dict({"page_size": PAGE}).layout().bytes_per_page
        argv = ["--limit", str(self.limit), "--l1-pages", str(self.l1_pages), "--l2-gib",
                repr((self.l2_pages + 1) * page_bytes / 2**30), "--device", "cpu", "--io-backend", "cpu",
                "--set", "pin_host=false", "--set", f"page_size={PAGE}", "--no-verify"]  # fmt: skip
        return [*(["--trace", str(self.trace)] if self.trace else []), *argv]

    def replay_args(self) -> argparse.Namespace:
        p = argparse.ArgumentParser(prog="hicache-cp replay")
        replay_command.add_arguments(p)
        return p.parse_args(self.replay_argv())

    def requests(self) -> list[TraceRequest]:
        return load_requests(self.replay_args())


def run_replay(shape: Shape, requests: list[TraceRequest]) -> list[OpShape]:
    """`hicache-cp replay` with its own device pool; `requests` is `shape.requests()` (replay loads its own)."""
    with Recorder().plans() as rec:
        report = replay_command.replay(shape.replay_args())
    assert report["l1_capacity_pages"] == shape.l1_pages, (report["l1_capacity_pages"], shape.l1_pages)
    return rec.ops


def run_sglang(shape: Shape, requests: list[TraceRequest]) -> list[OpShape]:
    from hicache_harness.bench.sglang import _token_bytes
    from hicache_harness.sglang.server import ServerSpec, SGLangPrefillServer

    spec = ServerSpec(backend="hicache-cp", page_size=PAGE, device_pages=shape.l1_pages, check_bytes=False,
                      chunk_tokens=CHUNK_PAGES * PAGE,
                      context_len=max(64 * 1024, max(r.input_length for r in requests) * 2))  # fmt: skip
    l2_bytes = (shape.l2_pages + 1) * _token_bytes(spec) * PAGE
    env = {"HICACHE_HOST_BUDGET_BYTES": str(l2_bytes), "HICACHE_IO_BACKEND": "cpu", "HICACHE_PIN_HOST": "false"}
    with tempfile.TemporaryDirectory(prefix="alloc-shapes-") as tmp, Recorder().plans() as rec:
        server = SGLangPrefillServer(spec, Path(tmp), tree_cache_kwargs={"env": env})
        try:
            for i, r in enumerate(requests):
                tokens = request_tokens(r, PAGE)
                if len(tokens) < 2:
                    continue
                server.submit(tokens.tolist(), rid=f"q{i}")
                server.run_until_idle()
                server.settle()
        finally:
            server.close()
    return rec.ops


def run_vllm(shape: Shape, requests: list[TraceRequest]) -> list[OpShape]:
    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "bench" / "engines"))
    import test_vllm_bench as H
    import vllm_compare

    # a trace block is one 16-token page here (vllm_compare's prompts), plus a partial page
    prompts = [vllm_compare._prompt(list(r.hash_ids), i) for i, r in enumerate(requests)]
    max_len = max(len(p) for p in prompts) + H.BLOCK
    with tempfile.TemporaryDirectory(prefix="alloc-shapes-vllm-") as tmp, Recorder().submits() as rec:
        b = H.make_bench(H.write_model_dir(Path(tmp) / "model"), num_blocks=shape.l1_pages, host_pages=shape.l2_pages,
                         max_batched=CHUNK_PAGES * H.BLOCK, max_model_len=max_len, debug_checks=False)  # fmt: skip
        try:
            for prompt in prompts:  # one request at a time, run to completion (as vllm_compare)
                b.add(prompt)
                b.run(max_steps=10_000)
        finally:
            b.close()
        assert not b.mismatches, b.mismatches[:4]
    return rec.ops


RUNNERS: dict[str, Callable[[Shape, list[TraceRequest]], list[OpShape]]] = {
    "replay": run_replay, "sglang": run_sglang, "vllm": run_vllm}  # fmt: skip


# ---- the report --------------------------------------------------------------------------------


def table(result: dict[str, Any]) -> str:
    lines = ["| workload | L1 allocator | copy | ops | pages / op | descriptors / op (p50, p90) | pages / descriptor "
             "| one descriptor | sorted: descriptors / op | device runs / op (p50, p90) | pages / device run "
             "| one device run |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for wname, work in result["workloads"].items():
        for name, rows in work["engines"].items():
            for d, r in rows.items():
                x, v = r["descriptors"], r["device_runs"]
                lines.append(f"| {wname} | {name} | {d} | {r['ops']} | {r['pages_per_op']:.1f} | {x['per_op']:.2f} "
                             f"({x['p50']:.0f}, {x['p90']:.0f}) | {x['pages_per']:.1f} | {x['one']:.2f} | "
                             f"{r['sorted_descriptors_per_op']:.2f} | {v['per_op']:.2f} "
                             f"({v['p50']:.0f}, {v['p90']:.0f}) | {v['pages_per']:.1f} | {v['one']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def measure(shape: Shape, engines: tuple[str, ...]) -> dict[str, Any]:
    requests = shape.requests()
    return {"trace": str(shape.trace) if shape.trace else "embedded default workload (seed 0)",
            "requests": len(requests), "pages": int(sum(len(r.hash_ids) for r in requests)),
            "engines": {e: summarise(RUNNERS[e](shape, requests)) for e in engines}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE, help="Mooncake-format trace (default: the shared one)")
    p.add_argument("--limit", type=int, default=400, help="first N requests of each workload")
    p.add_argument("--l1-pages", type=int, default=332, help="L1 pages (raised to hold 1.25x the longest prompt)")
    p.add_argument("--l2-pages", type=int, default=2048)
    p.add_argument("--workloads", default="trace,embedded", help="comma list of trace, embedded")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    engines = tuple(e for e in args.engines.split(",") if e)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    for name, given, known in (("--engines", engines, ENGINES), ("--workloads", workloads, ("trace", "embedded"))):
        bad = sorted(set(given) - set(known))
        if bad or not given:
            p.error(f"{name}: unknown or empty {bad or given!r}; choose from {', '.join(known)}")
    if args.limit < 1 or args.l1_pages < 1 or args.l2_pages < 1:
        p.error(f"--limit, --l1-pages and --l2-pages must be positive "
                f"(got {args.limit}, {args.l1_pages}, {args.l2_pages})")
    if "trace" in workloads and not args.trace.is_file():
        p.error(f"--trace {args.trace}: no such file")
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]), "commit": git_commit(), "machine": machine(),
        "page_size": PAGE, "chunk_pages": CHUNK_PAGES, "l2_pages": args.l2_pages, "workloads": {}}  # fmt: skip
    for w in workloads:
        shape = Shape(args.trace if w == "trace" else None, args.limit, args.l1_pages, args.l2_pages)
        # L1 must hold the longest prompt (SGLang admits nothing larger): raised to 1.25x it, as bench-sglang does
        longest = max(len(r.hash_ids) for r in shape.requests())
        shape = Shape(shape.trace, shape.limit, max(shape.l1_pages, -(-longest * 5 // 4) + 2), shape.l2_pages)
        result["workloads"][w] = {"l1_pages": shape.l1_pages, **measure(shape, engines)}
    print(table(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
