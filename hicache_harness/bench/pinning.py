"""`hicache-cp bench-pinning`: how soon a pinned host pool is usable, and whether it copies at full speed.

For each size of ``--gib`` (a comma list; the first size gets the variant
sweep), one run measures, with the pools alive one after the other:

1. **warm-up** (unless ``--no-warmup``): the size is mapped, prefaulted and
   freed once, unmeasured, so that the first measured pool does not pay the
   hypervisor's first touch of guest memory (a fresh VM does) while
   ``cudaHostAlloc`` after it would not (``warmup_s`` records what it cost);
2. **the arena with its defaults** (``--repeats`` times): time to the first
   usable chunk (``first_chunk_s``), to the whole pool (``ready_s``), when
   the last prefault finished (its gap to ``ready_s`` shows the overlap),
   thread-seconds spent in each, huge page coverage read back from
   ``/proc/self/smaps``, and ``close_s`` (unregister + unmap);
3. **variants** (first size only): other huge page / prefault / thread
   settings (``--variants``; spec ``HUGE:TOUCH[:rN][:tN][:cG]``, e.g.
   ``thp:populate:r4:t12``: THP, ``MADV_POPULATE_WRITE``, 4 registering and 12
   prefaulting threads; ``c0.5``: 0.5 GiB registration chunks), so the device
   run can pick the best default;
4. **cudaHostAlloc** of the same size (GPU): ``alloc_s`` and ``free_s``;
5. **copy bandwidth** (GPU), D2H and H2D of ``--copy-gib`` between one device
   buffer and the default arena, the cudaHostAlloc pool, and pageable memory
   (best of 3 after a warm-up, synchronised).

``speedup`` is ``cudaHostAlloc alloc_s / median(default ready_s)``;
``best_speedup`` uses the fastest variant. ``bandwidth_ratio`` is arena over
cudaHostAlloc per direction.

**The cross-chunk limit** (documented, not an error): the arena registers
``--chunk-gib`` at a time, and one CUDA copy whose host range spans two
registrations is rejected by the driver (``cudaErrorInvalidValue``). The
arena's copies here are cut at chunk boundaries with the copy engines' own
``hicache_cp.io.runs.split_at_chunks``, as the pool is used; the limit is
tested in ``tests/test_arena.py``.

Without CUDA the arena parts run unpinned (prefault and ``madvise`` timings,
huge page coverage) and the CUDA parts are skipped, so this runs in CI.
Before each pool the free host memory is checked (``hostmem.sizing``); a
pool that does not fit is skipped and recorded, never attempted (an OOM kill
would lose the run). Results are written after every step.

Exit status: 0 on a clean run, 1 when a measurement failed (listed under
``errors`` in the JSON and at the end of the table), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_harness import checks
from hicache_harness.errors import InputError
from hicache_harness.outputs import atomic_path
from hicache_harness.provenance import command_line, git_commit, machine
from hostmem import cuda
from hostmem.arena import HostArena, TouchMode
from hostmem.mapping import HugePages, hugetlb_pool, populate_supported, thp_mode
from hostmem.sizing import host_memory

logger = logging.getLogger(__name__)

GIB = 1 << 30
#: Variants swept at the first size. THP with each prefault mode, one and
#: several registering threads, fewer prefault threads (leaving cores to
#: the registrations), and base pages as the reference.
DEFAULT_VARIANTS = (
    "thp:populate:r1",
    "thp:populate:r4:t12",
    "thp:write:r4",
    "thp:none:r4",
    "thp:none:r16",
    "none:populate:r4",
)
#: Done-when targets of issue 18 (checked at 64 GiB when measured).
TARGET_SPEEDUP = 8.0
TARGET_BANDWIDTH_RATIO = 0.97
_COPY_REPEATS = 3
CROSS_CHUNK_LIMIT = (
    "one CUDA copy must not span two registration chunks (cudaErrorInvalidValue); "
    "arena copies are cut with hicache_cp.io.runs.split_at_chunks"
)


class BenchInputError(ValueError):
    """A bad command-line value (exit status 2)."""


@dataclass(frozen=True)
class Variant:
    """Arena settings to measure; None fields take the arena's defaults."""

    name: str
    huge_pages: HugePages | None = None
    touch: TouchMode | None = None
    register_threads: int | None = None
    touch_threads: int | None = None
    register_chunk_bytes: int | None = None

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("huge_pages", "touch", "register_threads", "touch_threads", "register_chunk_bytes"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


def parse_variant(text: str) -> Variant:
    """``default`` or ``HUGE:TOUCH[:rN][:tN][:cG]`` (HUGE: auto/thp/hugetlb/none; TOUCH:
    auto/populate/write/none; rN registering threads; tN prefault threads; cG
    registration chunk in GiB, else ``--chunk-gib``)."""
    text = text.strip()
    if text == "default":
        return Variant("default")
    parts = text.split(":")
    try:
        if len(parts) < 2:
            raise ValueError("needs at least HUGE:TOUCH")
        extra: dict[str, int] = {}
        for p in parts[2:]:
            key = {"r": "register_threads", "t": "touch_threads", "c": "register_chunk_bytes"}.get(p[:1])
            if key is None or key in extra:
                raise ValueError(f"bad field {p!r} (rN, tN or cG)")
            if key == "register_chunk_bytes":
                chunk = int(float(p[1:]) * GIB)
                if chunk <= 0 or chunk % 4096:
                    raise ValueError(f"bad field {p!r}: the chunk must be a positive number of 4 KiB pages")
                extra[key] = chunk
            elif p[1:].isdigit() and int(p[1:]) > 0:
                extra[key] = int(p[1:])
            else:
                raise ValueError(f"bad field {p!r}: N must be a positive integer")
        return Variant(text, HugePages(parts[0]), TouchMode(parts[1]), **extra)
    except ValueError as exc:
        raise BenchInputError(
            f"--variants: {text!r}: {exc}; the form is HUGE:TOUCH[:rN][:tN][:cG], HUGE in "
            f"{[h.value for h in HugePages]}, TOUCH in {[t.value for t in TouchMode]}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add bench-pinning's options to ``parser``."""
    parser.add_argument("--gib", default="64", help="pool sizes in GiB, comma-separated (default 64)")
    parser.add_argument("--chunk-gib", type=float, default=1.0, help="registration chunk, GiB (default 1)")
    parser.add_argument("--copy-gib", type=float, default=4.0, help="bytes per bandwidth copy, GiB (default 4)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of the default arena per size (default 2)")
    parser.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS),
        help="arena variants at the first size, comma-separated HUGE:TOUCH[:rN][:tN][:cG] ('' for none)",
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the unmeasured first touch of each size")
    parser.add_argument(
        "--reserve-gib", type=float, default=2.0,
        help="host memory left free beyond each pool; a pool that does not fit is skipped (default 2)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


@dataclass(frozen=True)
class _Args:
    sizes: list[float]
    chunk: int
    copy_bytes: int
    repeats: int
    variants: list[Variant]
    warmup: bool
    reserve: int
    json: Path | None


def _validate(args: argparse.Namespace) -> _Args:
    try:
        sizes = [float(x) for x in str(args.gib).split(",") if x.strip()]
    except ValueError:
        raise BenchInputError(f"--gib: {args.gib!r} is not a comma-separated list of numbers") from None
    if not sizes or any(not (0 < s < 1 << 20) for s in sizes):
        raise BenchInputError(f"--gib: every size must be in (0, 1048576) GiB, got {args.gib!r}")
    for name in ("chunk_gib", "copy_gib", "reserve_gib"):
        value = getattr(args, name)
        if not (0 <= value < 1 << 20) or (name != "reserve_gib" and value == 0):
            raise BenchInputError(f"--{name.replace('_', '-')}: {value} is out of range")
    chunk = int(args.chunk_gib * GIB)
    if chunk % 4096:
        raise BenchInputError(f"--chunk-gib: {args.chunk_gib} GiB is not a whole number of 4 KiB pages")
    if args.repeats < 1:
        raise BenchInputError(f"--repeats: must be >= 1, got {args.repeats}")
    variants = [parse_variant(v) for v in str(args.variants).split(",") if v.strip()]
    checks.output_file("--json", args.json)  # before any work, as every command checks it
    return _Args(
        sizes, chunk, int(args.copy_gib * GIB), args.repeats, variants, not args.no_warmup,
        int(args.reserve_gib * GIB), args.json,
    )


# -- measurements -----------------------------------------------------------------------------


class _Run:
    """The result record, its errors, and saving it after every step."""

    def __init__(self, a: _Args, use_cuda: bool) -> None:
        self.a = a
        self.use_cuda = use_cuda
        free, hp_size = hugetlb_pool()
        mem = host_memory(reserve_bytes=0)
        self.result: dict[str, Any] = {
            "command": command_line("bench-pinning"),
            "commit": git_commit(),
            "machine": machine(),
            "gpu": torch.cuda.get_device_name() if use_cuda else None,
            "cuda": use_cuda,
            "kernel": platform.release(),
            "thp_mode": thp_mode(),
            "thp_defrag": _bracketed(Path("/sys/kernel/mm/transparent_hugepage/defrag")),
            "cuda_driver": cuda.driver_version() if use_cuda else None,
            "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "hugetlb_free_bytes": free * hp_size,
            "populate_supported": populate_supported(),
            "host_memory": {"source": mem.source.value, "total_gib": round(mem.total_bytes / GIB, 2),
                            "available_gib": round(mem.available_bytes / GIB, 2)},
            "chunk_gib": a.chunk / GIB,
            "copy_gib": a.copy_bytes / GIB,
            "cross_chunk_limit": CROSS_CHUNK_LIMIT,
            "sizes": [],
        }
        self.errors: dict[str, str] = {}

    def error(self, key: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, str):
            logger.error("%s failed", key, exc_info=exc)
        self.errors[key] = text
        _progress(f"error in {key}: {text}")

    def save(self) -> None:
        if self.errors:
            self.result["errors"] = dict(self.errors)
        if self.a.json is not None:
            with atomic_path(self.a.json) as tmp:
                tmp.write_text(json.dumps(self.result, indent=2) + "\n")

    def fits(self, nbytes: int) -> str | None:
        """None when ``nbytes`` fits in free host memory with the reserve, else why not."""
        mem = host_memory(reserve_bytes=self.a.reserve)
        if mem.pool_bytes >= nbytes:
            return None
        return f"needs {nbytes / GIB:.1f} GiB, host has {mem.describe()}"


def _measure_arena(
    run: _Run, nbytes: int, variant: Variant, keep: Callable[[HostArena], None] | None = None
) -> dict[str, Any]:
    """Build one arena, wait until whole, record its timings; ``keep`` uses it before close."""
    kwargs = {"register_chunk_bytes": run.a.chunk, **variant.kwargs()}
    arena = HostArena(nbytes, pin=run.use_cuda, name=variant.name, **kwargs)
    try:
        arena.wait_ready()
        huge = arena.huge_page_bytes()
        if keep is not None:
            keep(arena)
    finally:
        arena.close()
    t = arena.timings
    return {
        "variant": variant.name,
        "huge_pages": arena.huge_pages.value,
        "touch": arena.touch_mode.value,
        "touch_threads": arena.touch_threads,
        "register_threads": arena.register_threads if arena.pinned else 0,
        "dontfork": arena.dontfork,
        "chunk_gib": arena.register_chunk_bytes / GIB,
        "first_chunk_s": _r(t.first_chunk_s),
        "ready_s": _r(t.ready_s),
        "touch_done_s": _r(t.touch_done_s),
        "touch_busy_s": _r(t.touch_busy_s),
        "register_busy_s": _r(t.register_busy_s),
        "map_s": _r(t.map_s, 6),
        "advise_s": _r(t.advise_s, 6),
        "close_s": _r(t.close_s),
        "huge_bytes": huge,
        "huge_coverage": round(huge / nbytes, 4),
    }


def _warmup(run: _Run, nbytes: int) -> float:
    """Map, prefault (unpinned) and free ``nbytes`` once; returns the seconds it took."""
    t0 = time.perf_counter()
    with HostArena(nbytes, pin=False, register_chunk_bytes=run.a.chunk, name="warmup") as arena:
        arena.wait_ready()
    return time.perf_counter() - t0


def _timed_copies(copies: Callable[[], None]) -> float:
    """Best wall time of ``_COPY_REPEATS`` runs of ``copies`` after one warm-up, synchronised."""
    copies()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(_COPY_REPEATS):
        t0 = time.perf_counter()
        copies()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _bandwidth(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """D2H and H2D GB/s over ``(host, device)`` tensor pairs copied one ``copy_`` each."""
    nbytes = sum(h.numel() for h, _ in pieces)

    def d2h() -> None:
        for h, d in pieces:
            h.copy_(d, non_blocking=True)

    def h2d() -> None:
        for h, d in pieces:
            d.copy_(h, non_blocking=True)

    return {
        "d2h_gbps": round(nbytes / _timed_copies(d2h) / 1e9, 2),
        "h2d_gbps": round(nbytes / _timed_copies(h2d) / 1e9, 2),
        "copies": len(pieces),
    }


def _arena_pieces(arena: HostArena, dev: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[0, copy bytes)`` of the arena cut at its registration chunks, paired with ``dev``."""
    from hicache_cp.io.runs import split_at_chunks

    n = dev.numel()
    offsets, others, sizes = split_at_chunks(
        np.array([0]), np.array([0]), np.array([n]), arena.register_chunk_bytes
    )
    return [
        (arena.torch(int(o), int(s)), dev[int(d) : int(d) + int(s)])
        for o, d, s in zip(offsets.tolist(), others.tolist(), sizes.tolist())
    ]


def _measure_host_alloc(run: _Run, nbytes: int, dev: torch.Tensor | None, out: dict[str, Any]) -> None:
    """cudaHostAlloc of ``nbytes``: time to allocate, bandwidth, time to free."""
    import ctypes

    t0 = time.perf_counter()
    ptr = cuda.host_alloc(nbytes)
    out["cuda_host_alloc"] = {"alloc_s": _r(time.perf_counter() - t0)}
    _progress(f"cudaHostAlloc {nbytes / GIB:g} GiB in {out['cuda_host_alloc']['alloc_s']:.2f} s")
    try:
        if dev is not None:
            buf = (ctypes.c_uint8 * dev.numel()).from_address(ptr)
            view = torch.from_numpy(np.ctypeslib.as_array(buf))
            out["bandwidth"]["cuda_host_alloc"] = _bandwidth([(view, dev)])
            del view, buf
    finally:
        t0 = time.perf_counter()
        cuda.free_host(ptr)
        out["cuda_host_alloc"]["free_s"] = _r(time.perf_counter() - t0)


def _measure_size(run: _Run, gib: float, first: bool, dev: torch.Tensor | None) -> None:
    """Every step at one size; each step's failure is recorded and the next step still runs."""
    nbytes = int(gib * GIB)
    out: dict[str, Any] = {"gib": gib, "default": [], "variants": [], "bandwidth": {}, "skipped": {}}
    run.result["sizes"].append(out)
    tag = f"{gib:g}GiB"

    def step(key: str, fn: Callable[[], None], required: bool = True, need: int = nbytes) -> None:
        why = run.fits(need)
        if why is not None:
            if required:
                run.error(f"{tag}/{key}", f"skipped: {why}")
            else:
                out["skipped"][key] = why
                _progress(f"{tag} {key} skipped: {why}")
            run.save()
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failed measurement must not lose the others
            run.error(f"{tag}/{key}", exc)
        run.save()

    if run.a.warmup:
        step("warmup", lambda: out.__setitem__("warmup_s", _r(_warmup(run, nbytes))))
    for i in range(run.a.repeats):
        def keep(arena: HostArena, i: int = i) -> None:
            if i == 0 and dev is not None:
                pieces = _arena_pieces(arena, dev)
                out["bandwidth"]["arena"] = _bandwidth(pieces)
                del pieces[:]

        def default(keep: Callable[[HostArena], None] = keep) -> None:
            out["default"].append(_measure_arena(run, nbytes, Variant("default"), keep))
            _progress(f"{tag} default arena: {json.dumps(out['default'][-1])}")

        step(f"default#{i}", default)
    for v in run.a.variants if first else []:
        def variant(v: Variant = v) -> None:
            out["variants"].append(_measure_arena(run, nbytes, v))
            _progress(f"{tag} {v.name}: {json.dumps(out['variants'][-1])}")

        step(v.name, variant, required=False)
    if run.use_cuda:
        step("cuda_host_alloc", lambda: _measure_host_alloc(run, nbytes, dev, out))
        if dev is not None:
            def pageable() -> None:
                host = torch.ones(dev.numel(), dtype=torch.uint8)
                out["bandwidth"]["pageable"] = _bandwidth([(host, dev)])

            step("pageable", pageable, need=dev.numel())
    _summarise(out)
    run.save()


def _summarise(out: dict[str, Any]) -> None:
    """Speedups and bandwidth ratios of one size (where both sides were measured)."""
    ready = [r["ready_s"] for r in out["default"] if r.get("ready_s")]
    if ready:
        out["default_ready_s"] = _r(statistics.median(ready))
    runs = [r for r in out["default"] + out["variants"] if r.get("ready_s")]
    if runs:
        best = min(runs, key=lambda r: r["ready_s"])
        out["best_variant"], out["best_ready_s"] = best["variant"], best["ready_s"]
    alloc = out.get("cuda_host_alloc", {}).get("alloc_s")
    if alloc and ready:
        out["speedup"] = round(alloc / out["default_ready_s"], 2)
        out["best_speedup"] = round(alloc / out["best_ready_s"], 2)
    bw = out["bandwidth"]
    if "arena" in bw and "cuda_host_alloc" in bw:
        out["bandwidth_ratio"] = {
            d: round(bw["arena"][f"{d}_gbps"] / bw["cuda_host_alloc"][f"{d}_gbps"], 3) for d in ("d2h", "h2d")
        }


def _targets(run: _Run) -> dict[str, Any]:
    """Issue 18's done-when, on the 64 GiB size when measured (else the first size)."""
    sizes = run.result["sizes"]
    if not sizes or not run.use_cuda:
        return {}
    s = next((x for x in sizes if x["gib"] == 64), sizes[0])
    ratio = s.get("bandwidth_ratio", {})
    return {
        "gib": s["gib"],
        f"speedup>={TARGET_SPEEDUP:g}": s.get("speedup", 0) >= TARGET_SPEEDUP,
        f"bandwidth_ratio>={TARGET_BANDWIDTH_RATIO}": bool(ratio) and min(ratio.values()) >= TARGET_BANDWIDTH_RATIO,
        "no_errors": not run.errors,
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table; write JSON if asked. Returns the exit status."""
    try:
        a = _validate(args)
    except (BenchInputError, InputError) as exc:
        print(f"bench-pinning: error: {exc}", file=sys.stderr)
        return 2
    use_cuda = cuda.cuda_available() and torch.cuda.is_available()
    if not use_cuda:
        _progress("no CUDA here: arenas run unpinned; cudaHostAlloc and copy bandwidth are skipped")
    r = _Run(a, use_cuda)
    dev = None
    if use_cuda:
        torch.cuda.init()
        dev = torch.empty(a.copy_bytes, dtype=torch.uint8, device="cuda")
        dev.fill_(7)
        torch.cuda.synchronize()  # the context and the device buffer exist before any timing
    for i, gib in enumerate(a.sizes):
        _measure_size(r, gib, i == 0, dev)
    r.result["targets"] = _targets(r)
    r.save()
    _print_table(r.result)
    if a.json is not None:
        print(f"wrote {a.json}")
    return 1 if r.errors else 0


# -- output -----------------------------------------------------------------------------------


def _bracketed(path: Path) -> str | None:
    """The ``[chosen]`` word of a sysfs choice file, or None."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _progress(line: str) -> None:
    print(f"[bench-pinning] {line}", flush=True)


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _label(row: dict[str, Any]) -> str:
    """A variant's name; the default's with the settings it resolved to."""
    if row["variant"] != "default":
        return str(row["variant"])
    return f"default {row['huge_pages']}:{row['touch']}:r{row['register_threads']}:t{row['touch_threads']}"


def _print_table(r: dict[str, Any]) -> None:
    print(f"\nbench-pinning on {r['gpu'] or 'CPU only'}; THP {r['thp_mode']}; kernel {r['kernel']}; "
          f"chunk {r['chunk_gib']:g} GiB")
    head = f"{'size':>6} {'pool':<34}{'first s':>8}{'ready s':>8}{'touch s':>8}{'huge':>6}{'close s':>8}"
    print(head)
    for s in r["sizes"]:
        for row in s["default"] + s["variants"]:
            print(
                f"{s['gib']:>5g}G {_label(row):<34}{_fmt(row['first_chunk_s']):>8}"
                f"{_fmt(row['ready_s']):>8}{_fmt(row['touch_done_s']):>8}"
                f"{row['huge_coverage']:>6.0%}{_fmt(row['close_s']):>8}"
            )
        cha = s.get("cuda_host_alloc")
        if cha:
            print(f"{s['gib']:>5g}G {'cudaHostAlloc':<34}{'':>8}{_fmt(cha['alloc_s']):>8}{'':>14}{_fmt(cha.get('free_s')):>8}")
        for name, bw in s["bandwidth"].items():
            print(f"{s['gib']:>5g}G copy {name:<29} D2H {bw['d2h_gbps']:6.2f} GB/s  H2D {bw['h2d_gbps']:6.2f} GB/s"
                  f"  ({bw['copies']} copies)")
        if "speedup" in s:
            print(f"{s['gib']:>5g}G usable pool: default arena {s['speedup']}x faster than cudaHostAlloc "
                  f"(best variant {s['best_variant']}: {s['best_speedup']}x)")
        for key, why in s["skipped"].items():
            print(f"{s['gib']:>5g}G skipped {key}: {why}")
    if r.get("targets"):
        print(f"targets: {json.dumps(r['targets'])}")
    print(f"cross-chunk limit: {r['cross_chunk_limit']}")
    for key, err in r.get("errors", {}).items():
        print(f"error in {key}: {err}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache-cp bench-pinning", description=__doc__.splitlines()[0])
    add_arguments(parser)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
