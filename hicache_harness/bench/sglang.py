"""hicache-cp as SGLang's L2 beside SGLang's own tree caches, one request sequence, one process.

Each backend runs in `hicache_harness.sglang.server` (SGLang 0.5.23's pools, request
objects and scheduling functions, the stand-in forward checking every prefix
byte) with the same device capacity, page size and request sequence (a
Mooncake-format trace or the embedded workload, one request at a time in
arrival order, each block of the trace `tokens_per_block` tokens, chunked prefill of
4,096 tokens; the device tier holds at least 1.25 of the longest prompt):

    radix        SGLang's RadixCache: device tier only (what runs without a host tier)
    hicache-cp   --radix-cache-backend hicache-cp: SGLang's RadixCache plus hicache-cp's L2
    sglang-hicache  SGLang's own UnifiedRadixCache with --enable-hierarchical-cache and its
                 host pool and cache controller: attempted and recorded; on a CPU-only torch
                 it does not construct (its host pool registers memory with CUDA)

Reported per backend: prompt tokens served from the device tree, loaded from
host memory and computed; bytes each way; the scheduler thread's host time
in the tree cache, per call (p50 / p99) and per request.
"""

from __future__ import annotations

import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hicache_harness.sglang.server import SGLangPrefillServer, ServerSpec
from hicache_harness.trace import TraceRequest, request_tokens


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"calls": 0, "p50_us": 0.0, "p99_us": 0.0, "total_s": 0.0}
    a = np.asarray(xs)
    return {"calls": len(xs), "p50_us": float(np.percentile(a, 50) * 1e6), "p99_us": float(np.percentile(a, 99) * 1e6),
            "total_s": float(a.sum())}  # fmt: skip


def run_backend(backend: str, requests: Sequence[TraceRequest], *, tokens_per_block: int, device_pages: int,
                l2_bytes: int, check_bytes: bool, workdir: Path) -> dict[str, Any]:  # fmt: skip
    """Serve `requests` through one backend; its counters, bytes and host times."""
    env = {"HICACHE_HOST_BUDGET_BYTES": str(l2_bytes), "HICACHE_IO_BACKEND": "cpu", "HICACHE_PIN_HOST": "false"}
    spec = ServerSpec(backend=backend, device_pages=device_pages, check_bytes=check_bytes, chunk_tokens=4096,
                      context_len=max(64 * 1024, max(r.input_length for r in requests) * 2))  # fmt: skip
    server = SGLangPrefillServer(spec, workdir, tree_cache_kwargs={"env": env} if backend == "hicache-cp" else None)
    prompt_tokens = 0
    t0 = time.perf_counter()
    try:
        for i, req in enumerate(requests):
            tokens = request_tokens(req, tokens_per_block)
            if len(tokens) < 2:
                continue
            prompt_tokens += len(tokens)
            server.submit(tokens.tolist(), rid=f"q{i}")
            server.run_until_idle()
            server.settle()
        wall = time.perf_counter() - t0
        device = sum(d for d, _ in server.admissions.values())
        host = sum(h for _, h in server.admissions.values())
        report = server.forward.report
        out: dict[str, Any] = {
            "backend": backend,
            "requests": len(server.admissions),
            "prompt_tokens": prompt_tokens,
            "device_hit_tokens": device,
            "host_hit_tokens": host,
            "computed_tokens": report.computed_tokens,
            "checked_bytes": report.checked_bytes,
            "mismatched_bytes": report.mismatched_bytes,
            "wall_s": wall,
            "calls": {name: _percentiles(xs) for name, xs in server.times.seconds.items() if xs},
        }
        total = sum(c["total_s"] for c in out["calls"].values())
        out["tree_cache_host_s_per_request"] = total / max(1, len(server.admissions))
        if backend == "hicache-cp":
            stats = server.tree_cache.cache.stats()
            out["bytes_h2d"], out["bytes_d2h"] = stats["bytes_h2d"], stats["bytes_d2h"]
            out["evictions_l2"] = stats["evictions_l2"]
            out["l2_capacity_pages"] = stats["l2_capacity_pages"]
            out["plugin"] = vars(server.tree_cache.stats)
        else:
            out["bytes_h2d"] = out["bytes_d2h"] = 0
        return out
    finally:
        server.close()


def try_sglang_hicache(workdir: Path, page_size: int, device_pages: int) -> dict[str, Any]:
    """Build SGLang's own HiCache tree (UnifiedRadixCache + host pool + controller) as its
    factory does for --enable-hierarchical-cache; the outcome, with the exact error."""
    from hicache_harness.sglang.env import publish_server_args

    try:
        args = publish_server_args(workdir / "sglang-hicache", page_size=page_size, enable_hierarchical_cache=True,
                                   hicache_size=1, disable_overlap_schedule=True)  # fmt: skip
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_unified_radix_cache

        from hicache_harness.sglang.server import TpWorkerHooks, build_pools

        pools = build_pools(ServerSpec(device_pages=device_pages, page_size=page_size))
        ctx = TreeCacheBuildContext(
            server_args=args, params=pools.params, is_hybrid_swa=False, is_hybrid_ssm=False,
            enable_hierarchical_cache=True, disable_radix_cache=False, tp_worker=TpWorkerHooks(),
            model_config=ModelConfig.from_server_args(args), tp_size=1, tp_rank=0, tp_group=None, is_dsa=True,
        )  # fmt: skip
        cache = create_unified_radix_cache(ctx)
        return {"backend": "sglang-hicache", "constructed": True, "impl": type(cache).__name__}
    except Exception as exc:  # noqa: BLE001 - the outcome is the record
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames) if "sglang" in f.filename), "")
        return {"backend": "sglang-hicache", "constructed": False, "error": f"{type(exc).__name__}: {exc}", "at": where}


def side_by_side(requests: Sequence[TraceRequest], *, tokens_per_block: int = 64, device_pages: int = 256,
                 l2_pages: int = 2048, check_bytes: bool = True) -> dict[str, Any]:  # fmt: skip
    """Every backend on the same sequence; see the module docstring."""
    spec = ServerSpec()
    longest = max(len(request_tokens(r, tokens_per_block)) for r in requests)
    # The device tier must hold the longest prompt (SGLang admits nothing larger): it is raised
    # to 1.25 of that when smaller, and the result records what ran.
    device_pages = max(device_pages, -(-longest * 5 // 4 // spec.page_size) + 2)
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        work = Path(tmp)
        token_bytes = _token_bytes(spec)
        l2_bytes = (l2_pages + 1) * token_bytes * spec.page_size
        rows = [run_backend(b, requests, tokens_per_block=tokens_per_block, device_pages=device_pages,
                            l2_bytes=l2_bytes, check_bytes=check_bytes, workdir=work / b)
                for b in ("radix", "hicache-cp")]  # fmt: skip
        rows.append(try_sglang_hicache(work, spec.page_size, device_pages))
    return {"page_size": spec.page_size, "tokens_per_block": tokens_per_block, "device_pages": device_pages,
            "longest_prompt_tokens": longest,
            "l2_pages": l2_pages, "bytes_per_token": token_bytes, "backends": rows}  # fmt: skip


def _token_bytes(spec: ServerSpec) -> int:
    """Bytes a token holds in every part (latent per layer, indexer keys where owned, draft)."""
    latent = (spec.kv_lora_rank + spec.rope_dim) * 2
    index = 132 * sum(not s for s in spec.skip_topk)
    return spec.layers * latent + index + spec.draft_layers * (latent + 132)


def table(result: dict[str, Any]) -> str:
    """The side-by-side as a Markdown table."""
    head = ("| backend | device-hit tokens | host-hit tokens | computed | H2D MB | D2H MB | "
            "match p50/p99 us | load p50/p99 us | tree-cache ms/request | bytes checked (mismatched) |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for r in result["backends"]:
        if "prompt_tokens" not in r:
            lines.append(f"| {r['backend']} | not run: {r.get('error', '')} ({r.get('at', '')}) |" + " |" * 8)
            continue
        calls = r["calls"]
        match = calls.get("match_prefix", {"p50_us": 0, "p99_us": 0})
        load = calls.get("init_load_back", {"p50_us": 0.0, "p99_us": 0.0})
        lines.append(
            f"| {r['backend']} | {r['device_hit_tokens']:,} | {r['host_hit_tokens']:,} | {r['computed_tokens']:,} | "
            f"{r['bytes_h2d'] / 1e6:.1f} | {r['bytes_d2h'] / 1e6:.1f} | {match['p50_us']:.0f} / {match['p99_us']:.0f} | "
            f"{load['p50_us']:.0f} / {load['p99_us']:.0f} | {r['tree_cache_host_s_per_request'] * 1e3:.2f} | "
            f"{r['checked_bytes']:,} ({r['mismatched_bytes']}) |"
        )
    return "\n".join(lines)
