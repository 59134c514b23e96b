"""hicache-cp's vLLM connector beside vLLM 0.33's own OffloadingConnector, under vLLM's real Scheduler (CPU).

    .venv/bin/python bench/engines/vllm_compare.py [--json bench/results/vllm-compare.json]
        [--trace /work/shared/traces/synthetic_trace.jsonl --limit 80] [--requests 60 --seed 0]
        [--gpu-blocks 96 --host-pages 400] [--shape v3 --layers 2 --batch 1] [--connectors hicache,offloading]

Both connectors get the same request sequence, the same vLLM scheduler
config (prefix caching on, chunked prefill, GPU blocks few enough that vLLM's
own prefix cache evicts), the same host bytes and the same fake model runner
(tests/test_vllm_bench.py: every KV byte each attention layer reads is
checked). Ours runs with its real worker side (CPU copy engine); vLLM's with
its real scheduler side and connector worker, its CUDA copy worker replaced
by `HostCopyOffloadingWorker` (synchronous torch copies: every job finished
when submitted, the best case for vLLM's scheduler).

Reported per connector: prompt tokens served from vLLM's GPU prefix cache,
loaded from host memory and computed; blocks stored to host; engine steps;
the connector's host time per step on the scheduler side and on the worker
side, and per method (vLLM's calls of them timed, `vllm_race.StepTimer`;
vLLM's worker side here copies synchronously, so its worker time holds its
copies, ours its submissions and checks); KV mismatches. Then the failed-load
case: every load from host fails once, and what each connector does.

KV shape: `--shape v3` (MLA, the default) or `llama` (dense GQA, vLLM's own
allocation), `--layers` target layers (2 by default; the GPU race's model has
16). `--batch N` adds the requests N at a time (one step then schedules
several of them), 1 by default (each runs to completion before the next).

Workload: by default an embedded one (documents of 12-24 pages read by
several requests each, each with its own 1-3 page question, in a seeded
order that revisits a document after others pushed it out of the GPU); with
--trace, the first --limit requests of a Mooncake-format trace, each
512-token hash block mapped to one 16-token page (prefix structure kept,
lengths scaled down 32x). Results depend on the workload; the JSON names it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tools"))

import test_vllm_bench as H  # noqa: E402  (the bench: vLLM's Scheduler + fake model runner)

from hicache_harness.outputs import write_json  # noqa: E402
from hicache_harness.provenance import git_commit, machine  # noqa: E402
from hicache_cp.io.base import Direction  # noqa: E402
from vllm_race import StepTimer  # noqa: E402  (the race's timer of the connector's calls)

CONNECTORS = ("hicache", "offloading")
LABEL = {"hicache": "hicache-cp HiCacheConnector", "offloading": "vLLM OffloadingConnector (CPU)"}

# ---- workloads ------------------------------------------------------------------------------


def page_tokens(key: int) -> list[int]:
    """The 16 tokens of a page named `key` (deterministic, vocab 1000, never the sampled token)."""
    rng = np.random.default_rng(key + 1)
    return [int(t) for t in rng.integers(10, 1000, H.BLOCK)]


def embedded_workload(requests: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    docs = [list(range(1000 * d, 1000 * d + int(rng.integers(12, 25)))) for d in range(8)]
    out = []
    for i in range(requests):
        doc = docs[int(rng.integers(0, len(docs)))]
        question = [10_000_000 + 10 * i + q for q in range(int(rng.integers(1, 4)))]
        out.append(doc + question)
    return [_prompt(keys, i) for i, keys in enumerate(out)]


def trace_workload(path: Path, limit: int, max_pages: int) -> list[list[int]]:
    from hicache_harness.trace import load_trace

    return [_prompt(list(r.hash_ids[:max_pages]), i) for i, r in enumerate(load_trace(path, limit=limit))]


def _prompt(keys: list[int], i: int) -> list[int]:
    tokens = [t for k in keys for t in page_tokens(k)]
    return tokens + [900 + (i % 50)] * 5  # a partial last page: at least one token is always computed


# ---- one run ----------------------------------------------------------------------------------


def run_workload(connector: str, prompts: list[list[int]], model_dir: Path, gpu_blocks: int, host_pages: int,
                 max_steps: int = 20_000, shape: str = "v3", batch: int = 1) -> dict:
    b = H.make_bench(model_dir, connector=connector, num_blocks=gpu_blocks, host_pages=host_pages,
                     max_batched=256, debug_checks=False, shape=shape)
    timers = StepTimer(explicit=True)
    for role in (b.sched.connector, *b.workers):
        timers.wrap(role)
    first: dict[str, int] = {}  # req id -> tokens computed before its first scheduled step (local + external hit)
    loaded: dict[str, int] = {}
    computed = stored = steps = idle = 0
    try:
        for i in range(0, len(prompts), batch):  # `batch` at a time, run to completion: the order decides the hits
            rid = [b.add(prompt) for prompt in prompts[i : i + batch]][-1]
            for _ in range(max_steps):
                if not b.sched.requests:
                    break
                rec = b.step()
                timers.end_step()
                steps += 1
                idle += not rec.scheduled  # a step that only carried reports (a delayed block free)
                for r, (before, n) in rec.scheduled.items():
                    first.setdefault(r, before)
                    computed += n
                for r, _, pages in rec.loads:
                    loaded[r] = loaded.get(r, 0) + pages * H.BLOCK
                stored += sum(pages for _, _, pages in rec.saves)
            else:
                raise AssertionError(f"{connector}: {rid} unfinished after {max_steps} steps")
    finally:
        b.close()
    prompt_tokens = sum(len(p) for p in prompts)
    from_host = sum(loaded.values())
    hit = sum(first.values())
    timing = timers.summary()
    return {
        "connector": LABEL[connector],
        "requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "from_gpu_prefix_cache": hit - from_host,
        "from_host": from_host,
        "computed": computed,  # max_tokens=1: the token sampled at the end of prefill needs no step
        "blocks_stored": stored,
        "steps": steps - idle,
        "report_only_steps": idle,
        "sched_ms_per_step": _per_step(timing["scheduler"]),
        "worker_ms_per_step": _per_step(timing["worker"]),
        "by_method": timing["by_method"],
        "mismatches": len(b.mismatches),
    }


def failed_load(connector: str, model_dir: Path) -> dict:
    """An 85-token prompt computed and stored, vLLM's prefix cache dropped, then
    the same prompt whose load from host fails."""
    b = H.make_bench(model_dir, connector=connector, num_blocks=64, host_pages=64, debug_checks=False)
    prompt = list(range(100, 185))
    out: dict = {"connector": LABEL[connector]}
    try:
        b.add(prompt)
        b.run()
        b.drop_vllm_prefix_cache()
        if connector == "hicache":
            def fault(direction, part, layer):
                if direction is Direction.H2D:
                    raise RuntimeError("injected H2D fault")

            b.set_fault(fault)
        else:
            for w in b.workers:
                H.offloading_worker(w).fail_loads = True
        b.add(prompt)
        try:
            steps = b.run()
            out["outcome"] = "finished"
            out["invalid_blocks_reported"] = sum(len(s.invalid_blocks) for s in steps)
            out["recomputed_tokens"] = sum(n for s in steps for r, (before, n) in s.scheduled.items() if before == 0)
            # the bench sees the stale bytes of the failed load (layer by layer, before vLLM's
            # recompute path); after the recompute every byte must be right again
            out["stale_reads_during_failed_step"] = len(b.mismatches)
            b.mismatches.clear()
            b.set_fault(None)
            b.drop_vllm_prefix_cache()
            b.add(prompt)
            again = b.run()
            out["next_request_loads_from_host"] = sum(p for s in again for _, _, p in s.loads) * H.BLOCK
            out["mismatches_after_recovery"] = len(b.mismatches)
        except BaseException as exc:  # noqa: BLE001 - what vLLM's connector does is the result
            frame = [f for f in traceback.extract_tb(exc.__traceback__) if "/vllm/" in f.filename][-1:]
            out["outcome"] = "raised"
            out["error"] = f"{type(exc).__name__}: {exc}".strip()
            out["where"] = (f"{frame[0].filename.split('/vllm/', 1)[1]}:{frame[0].lineno}: {frame[0].line}"
                            if frame else None)
    finally:
        try:
            b.close()
        except Exception:  # noqa: BLE001 - a connector left broken by the fault
            pass
    return out


# ---- report -----------------------------------------------------------------------------------


def table(results: list[dict], failures: list[dict]) -> str:
    rows = [("", *(r["connector"] for r in results))]
    for key, name in (("from_gpu_prefix_cache", "prompt tokens from vLLM's GPU prefix cache"),
                      ("from_host", "prompt tokens loaded from host"), ("computed", "prompt tokens computed"),
                      ("blocks_stored", "blocks stored to host"), ("steps", "engine steps with a forward"),
                      ("report_only_steps", "engine steps carrying only reports (blocks held for a save)"),
                      ("mismatches", "KV mismatches")):
        rows.append((name, *(str(r[key]) for r in results)))
    for key, name in (("sched_ms_per_step", "scheduler-side"), ("worker_ms_per_step", "worker-side")):
        rows.append((f"{name} ms per step (mean / p99; mean CPU)",
                     *(f"{r[key]['mean']:.3f} / {r[key]['p99']:.3f}; {r[key]['cpu_mean']:.3f}" for r in results)))
    rows.append(("a load from host fails", *(_failure(f) for f in failures)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def _per_step(role: dict) -> dict:
    """A `StepTimer` role summary in this report's units (ms per step)."""
    return {"mean": role["mean_ms"], "p50": role["p50_ms"], "p99": role["p99_ms"], "total_ms": role["total_ms"],
            "cpu_mean": role["cpu_mean_ms"]}


def _failure(f: dict) -> str:
    if f["outcome"] == "raised":
        return f"the worker raises {f['error'].split(':')[0]} ({f['where'].split(':')[0]})"
    return f"blocks reported invalid, {f['recomputed_tokens']} tokens recomputed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "vllm-compare.json")
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--limit", type=int, default=80, help="requests of --trace")
    ap.add_argument("--requests", type=int, default=60, help="requests of the embedded workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu-blocks", type=int, default=96, help="vLLM's GPU KV blocks of 16 tokens")
    ap.add_argument("--host-pages", type=int, default=400, help="host memory, in 16-token blocks of all layers")
    ap.add_argument("--shape", choices=("v3", "llama"), default="v3", help="KV: MLA (v3) or dense GQA (llama)")
    ap.add_argument("--layers", type=int, default=H.TARGET_LAYERS, help="target layers of the model")
    ap.add_argument("--batch", type=int, default=1, help="requests added at once")
    ap.add_argument("--connectors", default=",".join(CONNECTORS), help="which of them to run")
    args = ap.parse_args(argv)
    for name in ("limit", "requests", "gpu_blocks", "host_pages", "layers", "batch"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.trace is not None and not args.trace.is_file():
        ap.error(f"--trace {args.trace}: no such file")
    connectors = args.connectors.split(",")
    if not connectors or set(connectors) - set(CONNECTORS):
        ap.error(f"--connectors {args.connectors!r}: a comma-separated list of {', '.join(CONNECTORS)}")
    import vllm

    max_pages = 60  # max_model_len 1024 of the bench
    prompts = (trace_workload(args.trace, args.limit, max_pages) if args.trace
               else embedded_workload(args.requests, args.seed))
    workload = ({"trace": str(args.trace), "limit": args.limit, "pages_per_hash_block": 1} if args.trace
                else {"embedded": "documents x questions", "requests": args.requests, "seed": args.seed})
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = H.write_model_dir(Path(tmp) / "tiny-deepseek", args.layers)
        results = [run_workload(c, prompts, model_dir, args.gpu_blocks, args.host_pages, shape=args.shape,
                                batch=args.batch) for c in connectors]  # fmt: skip
        failures = [failed_load(c, model_dir) for c in connectors]
    specs = H.layer_specs(args.shape, args.layers)
    report = {
        "commit": git_commit(), "machine": machine(),
        "command": " ".join(["bench/engines/vllm_compare.py", *(argv if argv is not None else sys.argv[1:])]),
        "vllm": vllm.__version__, "workload": workload,
        "config": {"block_size": H.BLOCK, "gpu_blocks": args.gpu_blocks, "host_pages": args.host_pages,
                   "host_bytes": args.host_pages * sum(s.page_bytes for s in specs), "prefix_caching": True,
                   "max_num_batched_tokens": 256, "batch": args.batch,
                   "kv": f"{args.layers} {'MLA' if args.shape == 'v3' else 'dense GQA'} layers, float32, "
                         f"{specs[0].page_bytes / 1024:g} KiB a block a layer"},
        "results": results, "failed_load": failures,
    }
    write_json(args.json, report)
    print(f"vLLM {vllm.__version__}, {len(prompts)} requests, {args.gpu_blocks} GPU blocks, "
          f"{args.host_pages} host blocks ({workload})")
    print(table(results, failures))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
