"""Copy-kernel experiments on the GPU (issue 13): what limits the kernel's H2D rate.

Run on a GPU host from the repository root (bench/device/io.sh STEPS=sweep
does, with the provenance line and the log):

    python3 bench/experiments/io_sweep.py --json bench/results/io-sweep-h200.json [--budget-s 200]

Sections (each writes the JSON when done, so a cut-short run keeps what it has):

* `submit_order`: host time of one 64-page submission for hybrid, kernel,
  hybrid, kernel in turn (is the first backend measured slower, or does the
  hybrid's run check cost?); plus `runs.run_starts` alone.
* `shapes`: scattered D2H/H2D rate of the kernel backend for every grid cap
  (`--fractions`), unroll (`--unrolls`) and tail (`kernels.TAILS`) at
  `--pages`.
* `contiguous`: the same kernel reading/writing consecutive pages on both
  sides: does it top at the scattered rate (the SM read path's ceiling)?
* `fixed_cost`: per-copy GPU time against the page count for a few shapes;
  a least-squares line gives the fixed cost per copy (launch, ramp, tail).
* `raw`: 64-page H2D copies launched back to back without the engine's
  per-copy event record/wait: what the ordering events cost on the GPU.
* `split`: one H2D copy split between the kernel backend and the `direct`
  backend (one DMA per page) running at the same time.

Rates are GB/s (1e9 B/s) of GPU time, gated like bench-io (every copy
queued behind a GPU sleep), median of `--repeats`; ratios are against the
contiguous pinned peak of the direction.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_harness.bench.io import _Gate, _page_sets, _pools, measure_peak
from hicache_harness.outputs import write_json
from hicache_harness.provenance import git_commit, machine
from hicache_cp.io import kernels
from hicache_cp.io.base import Direction, make_engine
from hicache_cp.io.runs import run_starts
from hicache_cp.layout import Part

PAGE_BYTES = 41984


def rate(gate: _Gate, engine: Any, sets: list[tuple[np.ndarray, np.ndarray]], backup: bool, repeats: int) -> float:
    """GB/s of copying every set once, one submission per set, gated; median of `repeats`."""
    layers = engine.layout.part(Part.TARGET_KV).layer_ids
    nbytes = sum(len(d) for d, _ in sets) * PAGE_BYTES

    def enqueue() -> None:
        t = None
        for i, (d, h) in enumerate(sets):
            layer = layers[i % len(layers)]
            t = engine.submit_backup(Part.TARGET_KV, layer, d, h) if backup else engine.submit_load(Part.TARGET_KV, layer, h, d)
        t.make_compute_wait()

    enqueue()
    torch.cuda.synchronize()
    ms = statistics.median(gate.time_ms(enqueue)[0] for _ in range(repeats))
    return nbytes / (ms * 1e-3) / 1e9


def sets_for(rng: np.random.Generator, n: int, dev: Any, host: Any, contiguous: bool = False) -> list[tuple[np.ndarray, np.ndarray]]:
    reps = int(np.clip((256 << 20) // (n * PAGE_BYTES), 3, 50))
    if contiguous:  # consecutive on both sides, a different start per set
        starts = rng.integers(1, min(dev.physical_pages, host.physical_pages) - n, size=(reps, 2))
        return [(np.arange(a, a + n, dtype=np.int64), np.arange(b, b + n, dtype=np.int64)) for a, b in starts]
    return _page_sets(rng, reps, n, dev.physical_pages, host.physical_pages)


def both(gate: _Gate, engine: Any, sets: list, repeats: int, peak: dict[str, float]) -> dict[str, float]:
    d2h = rate(gate, engine, sets, True, repeats)
    h2d = rate(gate, engine, sets, False, repeats)
    return {"d2h_gbps": d2h, "h2d_gbps": h2d, "d2h_ratio": d2h / peak["peak_d2h_gbps"], "h2d_ratio": h2d / peak["peak_h2d_gbps"]}


class Verifier:
    """Exact bytes of one 1000-page load and one backup (layer 1), per engine: a rate means nothing for a wrong copy."""

    def __init__(self, dev: Any, host: Any, rng: np.random.Generator) -> None:
        self.dev, self.host = dev, host
        self.pairs = [tuple(torch.from_numpy(a) for a in _page_sets(rng, 1, 1000, dev.physical_pages, host.physical_pages)[0])
                      for _ in range(2)]
        self.data = torch.randint(0, 256, (1000, PAGE_BYTES), dtype=torch.uint8)
        self.data_gpu = self.data.cuda()

    def __call__(self, engine: Any) -> bool:
        hview, dbuf = self.host.torch_view(Part.TARGET_KV)[1], self.dev.buffer(Part.TARGET_KV)[1]
        (d, h), (d2, h2) = self.pairs
        hview[h] = self.data
        dbuf[d.cuda()] = 0
        engine.submit_load(Part.TARGET_KV, 1, h.numpy(), d.numpy()).wait()
        ok = torch.equal(dbuf[d.cuda()], self.data_gpu)
        dbuf[d2.cuda()] = self.data_gpu
        hview[h2] = 0
        engine.submit_backup(Part.TARGET_KV, 1, d2.numpy(), h2.numpy()).wait()
        torch.cuda.synchronize()
        return ok and torch.equal(hview[h2], self.data)


def submit_order(dev: Any, host: Any, rng: np.random.Generator) -> dict[str, Any]:
    sets = _page_sets(rng, 50, 64, dev.physical_pages, host.physical_pages)
    out: dict[str, Any] = {"sequence": []}
    for name in ("hybrid", "kernel", "hybrid", "kernel"):
        engine = make_engine(name, dev, host)
        row: dict[str, Any] = {"backend": name}
        for label, backup in (("d2h", True), ("h2d", False)):
            us = []
            for i in range(300):
                d, h = sets[i % len(sets)]
                t0 = time.perf_counter()
                t = engine.submit_backup(Part.TARGET_KV, i % 2, d, h) if backup else engine.submit_load(Part.TARGET_KV, i % 2, h, d)
                us.append((time.perf_counter() - t0) * 1e6)
                if i % 25 == 24:
                    t.wait()
            torch.cuda.synchronize()
            row[f"{label}_submit_us"] = float(np.median(us[20:]))
            row[f"{label}_submit_us_p99"] = float(np.percentile(us[20:], 99))
        engine.close()
        out["sequence"].append(row)
        print(f"[sweep] submit {row}", flush=True)
    d, h = sets[0]
    t0 = time.perf_counter()
    for _ in range(2000):
        run_starts(d, h, 16)
    out["run_starts_scattered_64_us"] = (time.perf_counter() - t0) / 2000 * 1e6
    return out


def raw_launches(gate: _Gate, engine: Any, sets: list, repeats: int) -> float:
    """H2D GB/s of the engine's kernel launched back to back, no per-copy events."""
    stream = engine.stream(Direction.H2D)
    handle = int(stream.cuda_stream)
    ks, launcher, ctas = engine._kernels[1], engine._launchers[engine._handles[1][0]], engine.h2d_max_ctas
    dst = engine.device_layer_ptr(Part.TARGET_KV, 0)
    src = engine.host_layer_ptr(Part.TARGET_KV, 0)
    nbytes = sum(len(d) for d, _ in sets) * PAGE_BYTES

    def enqueue() -> None:
        stream.wait_stream(torch.cuda.current_stream())
        for d, h in sets:
            ks.launch(launcher, handle, ctas, src, dst, h, d, PAGE_BYTES)
        torch.cuda.current_stream().wait_stream(stream)

    enqueue()
    torch.cuda.synchronize()
    ms = statistics.median(gate.time_ms(enqueue)[0] for _ in range(repeats))
    return nbytes / (ms * 1e-3) / 1e9


def split_rate(gate: _Gate, kern: Any, dma: Any, sets: list, share: float, repeats: int) -> tuple[float, float]:
    """H2D GB/s with the last `share` of each set's pages on the direct backend,
    at the same time as the rest on the kernel backend; and the median host us per set."""
    nbytes = sum(len(d) for d, _ in sets) * PAGE_BYTES
    host_us: list[float] = []

    def enqueue() -> None:
        last = []
        for i, (d, h) in enumerate(sets):
            k = len(d) - int(round(share * len(d)))
            t0 = time.perf_counter()
            a = kern.submit_load(Part.TARGET_KV, i % 2, h[:k], d[:k])
            b = dma.submit_load(Part.TARGET_KV, i % 2, h[k:], d[k:]) if k < len(d) else None
            host_us.append((time.perf_counter() - t0) * 1e6)
            last = [a, b]
        for t in last:
            if t is not None:
                t.make_compute_wait()

    enqueue()
    torch.cuda.synchronize()
    ms = statistics.median(gate.time_ms(enqueue)[0] for _ in range(repeats))
    return nbytes / (ms * 1e-3) / 1e9, float(np.median(host_us))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--pages", default="64,1024,8192")
    ap.add_argument("--fractions", default="0.25,0.5,1.0")
    ap.add_argument("--unrolls", default="4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip the remaining sections past this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("io_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    t_start = time.time()
    rng = np.random.default_rng(1)
    gate = _Gate()
    sizes = [int(x) for x in args.pages.split(",")]
    fractions = [float(x) for x in args.fractions.split(",")]
    unrolls = [int(x) for x in args.unrolls.split(",")]
    res: dict[str, Any] = {"command": " ".join(["python3 bench/experiments/io_sweep.py", *sys.argv[1:]]), "commit": git_commit(), "machine": torch.cuda.get_device_name(),
                           "host": machine(), "page_bytes": PAGE_BYTES}

    def save(section: str) -> None:
        write_json(args.json, res)
        print(f"[sweep] {section} done at {time.time() - t_start:.0f} s", flush=True)

    def left() -> bool:
        return time.time() - t_start < args.budget_s

    peak = measure_peak(gate, 1 << 30)
    res.update(peak)
    save("peak")
    torch.cuda.empty_cache()
    dev, host = _pools(PAGE_BYTES, 2, 2 * max(sizes) + 1)
    res["submit_order"] = submit_order(dev, host, rng)
    save("submit_order")

    res["shapes"] = {}
    res["exact_bytes"] = {}
    verify = Verifier(dev, host, rng)
    sets = {n: sets_for(rng, n, dev, host) for n in sizes}
    for tail in kernels.TAILS:
        for unroll in unrolls:
            for f in fractions:
                if not left():
                    break
                key = f"f{f}_u{unroll}_{tail}"
                engine = make_engine("kernel", dev, host, sm_fraction=f, unroll=unroll, tail=tail)
                res["exact_bytes"][key] = verify(engine)
                res["shapes"][key] = {str(n): both(gate, engine, sets[n], args.repeats, peak) for n in sizes}
                engine.close()
                print(f"[sweep] {key} exact={res['exact_bytes'][key]} " + " ".join(f"{n}: {r['d2h_ratio']:.3f}/{r['h2d_ratio']:.3f}" for n, r in res["shapes"][key].items()), flush=True)
    save("shapes")

    best = max(res["shapes"], key=lambda k: res["shapes"][k]["64"]["h2d_ratio"] + res["shapes"][k]["1024"]["h2d_ratio"]) \
        if res["shapes"] else "f0.25_u4_loop"
    res["best_h2d_shape"] = best
    picks = {"f0.25_u4_loop": (0.25, 4, "loop"), best: _parse(best), "f1.0_u8_pred": (1.0, 8, "pred")}

    res["contiguous"] = {}
    for key, (f, u, tail) in picks.items():
        if not left():
            break
        engine = make_engine("kernel", dev, host, sm_fraction=f, unroll=u, tail=tail)
        res["contiguous"][key] = {str(n): both(gate, engine, sets_for(rng, n, dev, host, contiguous=True), args.repeats, peak)
                                  for n in (64, 1024, 8192) if n <= max(sizes)}
        engine.close()
        print(f"[sweep] contiguous {key} {json.dumps(res['contiguous'][key])}", flush=True)
    save("contiguous")

    res["fixed_cost"] = {}
    for key, (f, u, tail) in picks.items():
        if not left():
            break
        engine = make_engine("kernel", dev, host, sm_fraction=f, unroll=u, tail=tail)
        pts = {}
        for n in (16, 32, 64, 128, 256, 512, 1024):
            r = both(gate, engine, sets_for(rng, n, dev, host), args.repeats, peak)
            pts[str(n)] = {d: n * PAGE_BYTES / (r[f"{d}_gbps"] * 1e3) for d in ("d2h", "h2d")}  # us per copy
        engine.close()
        fit = {}
        for d in ("d2h", "h2d"):
            xs = np.array([int(n) for n in pts], dtype=float)
            ys = np.array([pts[n][d] for n in pts])
            slope, icpt = np.polyfit(xs, ys, 1)
            fit[d] = {"fixed_us": float(icpt), "us_per_page": float(slope), "streaming_gbps": PAGE_BYTES / (slope * 1e3)}
        res["fixed_cost"][key] = {"us_per_copy": pts, "fit": fit}
        print(f"[sweep] fixed cost {key} {json.dumps(fit)}", flush=True)
    save("fixed_cost")

    res["raw"] = {}
    for key, (f, u, tail) in picks.items():
        if not left():
            break
        engine = make_engine("kernel", dev, host, sm_fraction=f, unroll=u, tail=tail)
        s64 = sets[64] if 64 in sets else sets_for(rng, 64, dev, host)
        with_events = rate(gate, engine, s64, False, args.repeats)
        raw = raw_launches(gate, engine, s64, args.repeats)
        engine.close()
        res["raw"][key] = {"h2d_ratio_engine": with_events / peak["peak_h2d_gbps"], "h2d_ratio_raw": raw / peak["peak_h2d_gbps"]}
        print(f"[sweep] raw {key} {res['raw'][key]}", flush=True)
    save("raw")

    res["split"] = {}
    f, u, tail = _parse(best)
    kern = make_engine("kernel", dev, host, sm_fraction=f, unroll=u, tail=tail)
    dma = make_engine("direct", dev, host)
    for n in (64, 1024):
        for share in (0.0, 0.0625, 0.125, 0.25):
            if not left():
                break
            g, us = split_rate(gate, kern, dma, sets_for(rng, n, dev, host), share, args.repeats)
            res["split"][f"{n}_{share}"] = {"h2d_ratio": g / peak["peak_h2d_gbps"], "host_us_per_copy": us}
            print(f"[sweep] split {n} pages, DMA share {share}: {res['split'][f'{n}_{share}']}", flush=True)
    kern.close()
    dma.close()
    save("split")
    host.close()
    _table(res)
    return 0


def _parse(key: str) -> tuple[float, int, str]:
    f, u, tail = key.split("_")
    return float(f[1:]), int(u[1:]), tail


def _table(res: dict[str, Any]) -> None:
    print(f"peak D2H {res['peak_d2h_gbps']:.1f} GB/s, H2D {res['peak_h2d_gbps']:.1f} GB/s")
    print(f"{'shape':<18}" + "".join(f"{'D2H@' + n:>10}{'H2D@' + n:>10}" for n in next(iter(res['shapes'].values()), {})))
    for key, rows in res.get("shapes", {}).items():
        print(f"{key:<18}" + "".join(f"{r['d2h_ratio']:>10.3f}{r['h2d_ratio']:>10.3f}" for r in rows.values()))
    for key, rows in res.get("contiguous", {}).items():
        print(f"{'contig ' + key:<25}" + "".join(f" {n}: {r['d2h_ratio']:.3f}/{r['h2d_ratio']:.3f}" for n, r in rows.items()))
    for key, v in res.get("fixed_cost", {}).items():
        print(f"{'fixed ' + key:<25}" + "".join(f" {d}: {x['fixed_us']:.1f} us + {x['us_per_page']:.3f} us/page" for d, x in v["fit"].items()))
    for key, v in res.get("raw", {}).items():
        print(f"{'raw ' + key:<25} H2D@64 engine {v['h2d_ratio_engine']:.3f}, raw launches {v['h2d_ratio_raw']:.3f}")
    for key, v in res.get("split", {}).items():
        print(f"{'split ' + key:<25} H2D {v['h2d_ratio']:.3f}, host {v['host_us_per_copy']:.0f} us")
    for row in res.get("submit_order", {}).get("sequence", []):
        print(f"submit {row['backend']:<8} D2H {row['d2h_submit_us']:.1f}/{row['d2h_submit_us_p99']:.0f} us, "
              f"H2D {row['h2d_submit_us']:.1f}/{row['h2d_submit_us_p99']:.0f} us")


if __name__ == "__main__":
    sys.exit(main())
