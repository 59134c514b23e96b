"""Where bench-overhead's scheduler-thread time goes: its calls under cProfile.

bench-overhead times the cache's calls as a prefill scheduler makes them; this
runs it (same arguments) with cProfile on during the requests and writes the
functions of the scheduler thread by own time and what `load_back` and the
layer hook spend their time in. cProfile slows Python calls several-fold, so
read shares, not microseconds (bench-overhead's own numbers are the figures);
the issue workers' threads are not profiled. A driver call (`io.cudadrv`, through
ctypes) counts as its wrapper's own time, waits for the driver's lock included.

    python bench/experiments/profile_overhead.py --out profile.txt -- --device cuda --trace T --limit 1500
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path
from typing import Any

from hicache_harness.bench import overhead
from hicache_harness.provenance import git_commit, machine

#: The cache calls whose callees are listed (pstats matches these as regular expressions).
FOCUS = (r"lifecycle\.py:\d+\(load_back\)", r"lifecycle\.py:\d+\(_submit_all_layers\)",
         r"lifecycle\.py:\d+\(on_layer_end\)", r"dma\.py:\d+\(submit_layers?\)", r"cuda\.py:\d+\(submit_layers?\)",
         r"dma\.py:\d+\(_defer\)", r"cuda\.py:\d+\(_follow_compute\)", r"ops\.py:\d+\(record_layers?\)")
#: The cache's own modules, listed by cumulative time.
OWN = r"(hicache|lifecycle|eviction|prefix|ops|dma|cuda|issue|plans|radix|pools)\.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the report (text)")
    p.add_argument("--top", type=int, default=40, help="functions listed by own time")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="bench-overhead's arguments, after --")
    args = p.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    profile = cProfile.Profile()
    serve = overhead.serve

    def profiled(*a: Any) -> Any:  # the requests only: not the set-up, the pinning, the report
        profile.enable()
        try:
            return serve(*a)
        finally:
            profile.disable()

    overhead.serve = profiled
    rc = overhead.main(bench_args)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).strip_dirs()
    text.write(f"# bench-overhead {' '.join(bench_args)} (exit {rc}) under cProfile; commit {git_commit()}; {machine()}\n")
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(OWN, args.top)
    for pattern in FOCUS:
        stats.print_callees(pattern)
    args.out.write_text(text.getvalue())
    print(f"profile: {args.out}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
