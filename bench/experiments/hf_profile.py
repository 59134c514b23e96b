#!/usr/bin/env python
"""Where the real engine's prefill time goes (issue 14): isolated forwards, a
torch profile of one hit forward, and a cProfile of a short serve.

    python bench/experiments/hf_profile.py --out DIR [--preset dsv32-width] [--device cuda]

Writes DIR/hf-profile.json (timings), DIR/hit-forward-ops.txt (torch
profiler, top ops by device and by host time) and DIR/serve-cprofile.txt
(the scheduler's host time by function). A development tool: its numbers
explain bench results, they are not bench results themselves.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hicache_harness.engines import hf_model  # noqa: E402
from hicache_harness.engines.hf_forward import PagedForward, PagedKV, ScratchKV, SeqChunk, SeqPlan  # noqa: E402


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def recompute_s(fw: PagedForward, ids: np.ndarray, chunk: int, ps: int) -> float:
    dev = fw.m.device
    store = ScratchKV()
    t0 = _sync(dev)
    pos = 0
    while pos < len(ids):
        end = min(len(ids), pos + chunk)
        nxt = None if end == len(ids) else int(ids[end])
        plan = SeqPlan.build(SeqChunk(ids[pos:end], pos, None, 0, 0, nxt), ps)
        r = fw.run([(plan, store.bind(plan))])
        pos = end
    r.logits.cpu()
    return _sync(dev) - t0


def paged_s(fw: PagedForward, bufs: dict, seqs: list[SeqChunk], ps: int) -> float:
    dev = fw.m.device
    t0 = _sync(dev)
    plans = [SeqPlan.build(s, ps) for s in seqs]
    r = fw.run([(p, PagedKV(bufs, p)) for p in plans])
    r.logits.cpu()
    return _sync(dev) - t0


def hit_chunk(rng: np.random.Generator, prefix: int, q: int, first_page: int, ps: int, vocab: int) -> SeqChunk:
    n = prefix + q
    pages = np.arange(first_page, first_page + -(-n // ps))
    ids = rng.integers(0, vocab, q)
    return SeqChunk(ids, prefix, pages, prefix, prefix + q // ps * ps, None)


def first_shape_profile(fw: PagedForward, bufs: dict, rng: np.random.Generator, N: int, ps: int, vocab: int) -> str:
    """Host-side ops of a hit forward of a shape never seen before (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    seq = hit_chunk(rng, N - 1024 - 64 * 41, 219, 1, ps, vocab)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        paged_s(fw, bufs, [seq], ps)
    text = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    print(text, flush=True)
    return text


def new_shape_costs(model: Any, bufs: dict, rng: np.random.Generator, N: int, ps: int, vocab: int,
                    names: list[str]) -> dict:  # fmt: skip
    """Hit forwards of (tail, prefix) shapes never seen before, then the same
    shapes again, with the forward restricted to each SDPA backend
    ("engine": the engine's own choice): what a first-seen shape costs."""
    from torch.nn.attention import SDPBackend

    out = {}
    backends = {"engine": None, "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH],
                "cudnn": [SDPBackend.CUDNN_ATTENTION]}  # fmt: skip
    for i, (name, which) in enumerate(backends.items()):
        if name not in names:
            continue
        fw = PagedForward(model, attention=which)
        shapes = [(N - 1024 - 64 * (7 * i + k), 200 + 37 * k + 11 * i) for k in range(5)]
        seqs = [hit_chunk(rng, p, q, 1, ps, vocab) for p, q in shapes]
        try:
            first = [paged_s(fw, bufs, [s], ps) for s in seqs]
            again = [paged_s(fw, bufs, [s], ps) for s in seqs]
        except Exception as exc:  # noqa: BLE001 - a backend that cannot run these shapes
            out[name] = {"error": str(exc)[:300]}
            continue
        out[name] = {"shapes": shapes, "first_s": first, "again_s": again}
        print(name, "first", [round(x, 4) for x in first], "again", [round(x, 4) for x in again], flush=True)
    return out


def median(f, reps: int = 3) -> float:
    f()
    return statistics.median(f() for _ in range(reps))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="dsv32-width")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--serve-limit", type=int, default=16)
    ap.add_argument("--only-shapes", action="store_true", help="only the new-shape cost per attention backend")
    ap.add_argument("--backends", default="engine,efficient,math,cudnn", help="SDPA backends for the new-shape costs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    m = hf_model.build(args.preset, args.device)
    ps = m.preset.page_size
    print(f"built {args.preset} in {time.perf_counter() - t:.1f} s", flush=True)
    fw = PagedForward(m)
    rng = np.random.default_rng(0)
    N = args.tokens
    ids = rng.integers(0, m.vocab_size, N)
    bufs = m.kv_buffers(N // ps + 16 + 4096 // ps)
    out: dict = {"preset": args.preset, "tokens": N}
    out["new_shapes"] = new_shape_costs(m, bufs, rng, N, ps, m.vocab_size, args.backends.split(","))
    if args.only_shapes:
        if m.device.type == "cuda":
            out["first_shape_ops"] = first_shape_profile(fw, bufs, rng, N, ps, m.vocab_size)
        (args.out / "hf-profile.json").write_text(json.dumps(out, indent=1))
        print(json.dumps(out, indent=1))
        return 0

    for chunk in (2048, 1024, 512):
        out[f"recompute_{N}_chunk{chunk}_s"] = median(lambda: recompute_s(fw, ids, chunk, ps))
        print(f"recompute {N} tokens, chunk {chunk}: {out[f'recompute_{N}_chunk{chunk}_s']:.4f} s", flush=True)
    for q in (128, 512):
        seq = hit_chunk(rng, N - 512, q, 1, ps, m.vocab_size)
        out[f"hit_forward_P{N - 512}_Q{q}_s"] = median(lambda: paged_s(fw, bufs, [seq], ps))
        print(f"hit forward P={N - 512} Q={q}: {out[f'hit_forward_P{N - 512}_Q{q}_s']:.4f} s", flush=True)
    hit = hit_chunk(rng, N - 512, 512, 1, ps, m.vocab_size)
    big = SeqChunk(rng.integers(0, m.vocab_size, 2048), 2048, np.arange(N // ps + 8, N // ps + 8 + 4096 // ps), 2048, 4096, 7)
    out["batch_hit512_with_chunk2048_s"] = median(lambda: paged_s(fw, bufs, [hit, big], ps))
    out["chunk2048_alone_P2048_s"] = median(lambda: paged_s(fw, bufs, [big], ps))
    for k in ("batch_hit512_with_chunk2048_s", "chunk2048_alone_P2048_s"):
        print(f"{k}: {out[k]:.4f}", flush=True)

    if m.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        seq = hit_chunk(rng, N - 512, 512, 1, ps, m.vocab_size)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            paged_s(fw, bufs, [seq], ps)
        ka = prof.key_averages()
        text = ka.table(sort_by="self_cuda_time_total", row_limit=25) + "\n\n" + ka.table(sort_by="self_cpu_time_total", row_limit=25)
        (args.out / "hit-forward-ops.txt").write_text(text)
        print(ka.table(sort_by="self_cuda_time_total", row_limit=12), flush=True)

    trace = ROOT / ".devdata" / "serve-6k.jsonl"
    if not trace.is_file():
        from hicache_harness.trace import write_trace
        from hicache_harness.workload import default_workload

        trace.parent.mkdir(exist_ok=True)
        write_trace(trace, [r for r in default_workload(seed=0) if r.full_blocks >= 16])
    from hicache_harness.cli import main as cli

    argv = ["replay", "--engine", "hf", "--hf-preset", args.preset, "--device", args.device, "--trace", str(trace),
            "--tokens-per-block", "384", "--l2-fraction", "0.5", "--l1-pages", "300", "--arrivals", "asap",
            "--limit", str(args.serve_limit), "--json", str(args.out / "serve-profiled.json")]
    prof = cProfile.Profile()
    t = time.perf_counter()
    out["serve_rc"] = prof.runcall(cli, argv)
    out["serve_profiled_wall_s"] = time.perf_counter() - t
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(60)
    st.sort_stats("tottime").print_stats(40)
    (args.out / "serve-cprofile.txt").write_text(s.getvalue())
    (args.out / "hf-profile.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
