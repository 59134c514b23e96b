#!/usr/bin/env python
"""Host time of `load_back` with the real model's layout (issue 14), and where it goes.

    python bench/experiments/load_profile.py [--device cuda] [--out DIR]

Five 132-page prefixes (the serve's prompts) are computed and backed up, then
loaded back in turn while L1 (300 pages) is full of older prefixes, as in
`bench/device/serve.sh`. Prints the wall time of each `load_back` and a
cProfile of them (DIR/load-profile.txt). A development tool, not a bench.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hicache_cp.cache import HiCache  # noqa: E402
from hicache_cp.config import Config  # noqa: E402
from hicache_harness.engines import hf_model  # noqa: E402
from hicache_cp.layout import Model  # noqa: E402

PS, L1, L2, DOC_PAGES = 64, 300, 873, 132


PHASES: dict[str, list[float]] = {}


def _timed(cls: type, name: str) -> None:
    """Record the wall time of every call of `cls.name` in PHASES[name] (ms)."""
    f = getattr(cls, name)

    def timed(*a, **k):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            PHASES.setdefault(name, []).append((time.perf_counter() - t) * 1e3)

    setattr(cls, name, timed)


def serve(c: HiCache, tokens: np.ndarray, times: list | None = None, prof: cProfile.Profile | None = None) -> None:
    m = c.match_prefix(tokens)
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    load = c.load_back(m)
    if prof is not None:
        prof.disable()
    if times is not None:
        times.append((time.perf_counter() - t0) * 1e3)
    n = len(tokens) // PS
    new = c.alloc_device(n - m.matched_pages, m.matched_pages)
    b = c.reserve_backup(new, m.matched_pages)
    for model in (Model.TARGET, Model.DRAFT):
        for layer in range(c.layout.num_layers(model)):
            if load is not None:
                load.wait_layer(layer, model)
            c.on_layer_end(model, layer, [b])
    c.settle()
    node = c.insert(m, new, backup=b)
    c.release(node)
    c.poll()
    c.ensure_free()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    lay = hf_model.layout_of("dsv32-width")
    cuda = args.device != "cpu"
    bpp = Config(model_layout=lay, page_size=PS, host_budget_bytes=1 << 30).layout().bytes_per_page
    cfg = Config(model_layout=lay, page_size=PS, l1_pages=L1, host_budget_bytes=(L2 + 1) * bpp,
                 io_backend="hybrid" if cuda else "cpu", pin_host=cuda)  # fmt: skip
    c = HiCache(cfg, device=args.device)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, DOC_PAGES * PS) for _ in range(5)]
    for d in docs:
        serve(c, np.concatenate([d, rng.integers(0, 1000, 100)]))
    c.drain()
    from hicache_cp.cache.eviction import Evictor
    from hicache_cp.cache.lifecycle import Lifecycle

    times: list[float] = []
    _timed(Evictor, "alloc_device")
    _timed(Lifecycle, "_submit_all_layers")
    _timed(Lifecycle, "_submit")
    for i in range(args.rounds):  # unprofiled
        serve(c, np.concatenate([docs[i % 5], rng.integers(0, 1000, 200)]), times)
    print(f"load_back ms over {len(times)} loads of {DOC_PAGES} pages: median {np.median(times):.3f} "
          f"p90 {np.percentile(times, 90):.3f}; io {getattr(c.engine, 'counts', '')}")
    for name, v in PHASES.items():
        print(f"  {name}: {len(v)} calls, median {np.median(v):.3f} ms, p90 {np.percentile(v, 90):.3f} ms")
    prof = cProfile.Profile()
    for i in range(10):
        serve(c, np.concatenate([docs[i % 5], rng.integers(0, 1000, 200)]), None, prof)
    c.drain()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(30)
    print(s.getvalue()[:6000])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load-profile.txt").write_text(s.getvalue())
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
