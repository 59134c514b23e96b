"""`hicache-cp bench-io`: what the CUDA copy engine gets out of PCIe, and what it costs the host.

One run measures, on the current GPU:

* peak: one big contiguous pinned copy D2H and H2D, and both at once on two
  streams (the link's ceilings);
* every variant's (`--backends`) D2H and H2D bandwidth over random
  scattered page sets of each `--pages` size (random permutations on both
  sides, so nothing coalesces), against the peak, and the host time of each
  submission (one layer of one part) on the caller's thread;
* the same on `--runs-backends` with pages in runs of `--run-pages`
  consecutive pages on both sides (the shape the contiguous-preferring
  allocators produce; runs in random order);
* the engine's bidirectional rate: backups and loads at the same time;
* load overlap: N layers (default DeepSeek-V3.2's 61), loads of all of
  them submitted up front in one `submit_layers` (the cache's load_back), the
  forward waiting per layer (`make_compute_wait`) before matmuls sized so
  compute per layer is at least copy per layer. `exposed_load_fraction` =
  (time with loads - compute-only time) / copy-only time, clipped at 0; its
  floor is one layer's copy (1 / N), which nothing can hide;
* backup overlap: the same forward, each layer's backup submitted after its
  compute (the layer hooks), all backups awaited at the end:
  `exposed_backup_fraction` is what the backups add to the forward (a copy
  kernel's CTAs take SMs from it; DMA takes none);
* the kernel backend at several grid caps (`--kernel-sm-fractions`).

Warm-up: before the first variant, the default backend submits copies of
every size for `_WARMUP_S` seconds, unmeasured: the first variant measured
was otherwise slower on the host (H200, 64 pages: 28 us per submission
against 21 us for the same backend measured again later, bench/experiments/io_sweep.py).

Timing: CUDA events around GPU work. Each timed batch is gated behind a GPU
sleep on the compute stream, so every submission is queued before the GPU
starts and the rate is the GPU's, not Python's. The host cost of one
submission is timed call by call: `submit_us` (median) and `submit_us_p99`,
over the gated batches plus `_SUBMIT_SAMPLES` more; each batch's tickets are
retired before the next is queued, as a server retires an op's tickets at its
commit (kept all, every submission of the first direction measured created
its events inside the timed call: D2H at 64 pages 81 us against 14 us for
H2D, bench/results/archive/io-h200-direct-be5b46c.json). The default backend's
rows at 64, 1024 and 8192 pages are repeated under `default_numbers`. Each
rate is the median of several repetitions. GB/s are 1e9 bytes per second.

Submissions take the cache's path: each page set is planned once
(`CopyEngine.plan`, timed apart as `plan_us`) and submitted per layer
(`submit_layer`).

Variants: the product's backend with its defaults (`direct`, the default on
CUDA), the benchmark-only engines (`hybrid`, `kernel`, `staging`, registered by
`io_variants`) and experiments: `kernel-l2hint`, `kernel-tma` (the kernel's other
modes), `kernel-tma-4sm`/`-8sm` (SGLang's CTA counts), `direct-inline` (every
descriptor issued on the caller's thread, no issue worker), and the issue
worker's call sizes and the layer hook's paths (`io_variants` lists them all).
Exposure is measured for every variant and every grid cap of the kernel sweep at
`--overlap-pages`, and for the default at each `--exposure-pages`, scattered and
in runs (`exposure`).

Without CUDA it prints one error line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_cp.checksum import Verify
from hicache_cp.presets import PRESETS
from hicache_harness.bench.io_variants import VARIANTS
from hicache_harness.errors import InputError
from hicache_harness.outputs import write_json
from hicache_harness.provenance import command_line, git_commit, machine
from hicache_cp.io.base import CopyEngine, Direction, TicketState, default_backend, make_engine
from hicache_cp.io import checksum_gpu
from hicache_cp.layout import KVLayout, Part

#: Measured variants: label -> (backend name, engine options). The plain names are
#: the backends as `make_engine` builds them (the default's row is the headline).
BACKENDS = ("direct", "direct-backup1024", "direct-chunk1024", "direct-inline", "hybrid", "kernel", "kernel-tma", "kernel-tma-4sm", "kernel-tma-8sm")
TARGETS = {
    "scattered_ratio_1024plus": 0.90, "scattered_ratio_64": 0.85, "runs_ratio_1024plus": 0.93, "runs_ratio_64": 0.90,
    "bidir_ratio": 0.90, "exposed_load_fraction": 0.05, "exposed_backup_fraction": 0.10,
    "submit_us_64": 30.0, "submit_us_8192": 100.0,
}
#: Layers of the overlap test and the exposure rows: the model's (DeepSeek-V3.2, whose
#: 656 B a token the default page is). The floor, one layer's copy that nothing can
#: hide, is 1/61 at every page count (1/24 before 2026-12: 64-page loads measured 0.065
#: against a floor of 0.042, io-h200.json at ef4f07b); at 8192 pages each pool holds 21 GB.
_EXPOSURE_LAYERS = PRESETS["deepseek-v3.2"].num_layers
#: Host-only submissions timed per page count and direction (besides the gated batches).
_SUBMIT_SAMPLES = 40
#: Page counts whose numbers of the default backend are recorded on their own.
_DEFAULT_SIZES = ("64", "1024", "8192")
_REPEATS = 3
#: Seconds of unmeasured submissions before the first variant (see Warm-up).
_WARMUP_S = 1.0
#: Longest gate: beyond it the measurement is host-bound and says so.
_MAX_SLEEP_MS = 400.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add bench-io's options to `parser`."""
    parser.add_argument("--pages", default="64,1024,8192", help="comma-separated page counts per copy")
    parser.add_argument("--page-bytes", type=int, default=41984, help="bytes of one page of one layer (default: 64 tokens x 656 B)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"variants to measure, of {', '.join(VARIANTS)}")
    parser.add_argument("--peak-mib", type=int, default=1024, help="size of the contiguous peak copies")
    parser.add_argument("--overlap-layers", type=int, default=_EXPOSURE_LAYERS, help="layers of the overlap test (default: DeepSeek-V3.2's)")
    parser.add_argument("--overlap-pages", type=int, default=1024, help="pages per layer in the overlap test")
    parser.add_argument("--kernel-sm-fractions", default="0.03,0.06,0.12,0.25",
                        help="grid caps of the kernel backend sweep, with exposure ('' skips it)")
    parser.add_argument("--runs-backends", default="direct,hybrid,kernel", help="variants also measured on pages in runs ('' skips it)")
    parser.add_argument("--exposure-pages", default="64,1024,8192",
                        help="page counts of the exposure rows, scattered and in runs ('' skips them)")
    parser.add_argument("--exposure-backends", default="",
                        help="variants with exposure rows besides the default backend (comma-separated)")
    parser.add_argument("--run-pages", type=int, default=128, help="consecutive pages per run of the runs pattern")
    parser.add_argument("--alloc-runs", type=Path,
                        help="instead of the sweep: copy the page lists of a bench-alloc JSON (its sample_runs) "
                             "with the default backend and direct")
    parser.add_argument("--verify", choices=[m.value for m in Verify], default="off",
                        help="restore checks on the variants' engines (hicache_cp.checksum): their pools keep "
                             "checksums and every planned copy's ticket includes its checks (default off)")
    parser.add_argument("--checksum-programs-per-sm", type=int, metavar="N",
                        help="the restore checks' kernel launches at N programs per SM, 0 for one per page "
                             "(hicache_cp.io.checksum_gpu.PROGRAMS_PER_SM; default: the library's)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")


#: The restore checks of the variants' engines (`--verify`), set once by `run`.
_VERIFY = Verify.OFF


class _Gate:
    """Times GPU work queued behind a sleep on the current stream."""

    def __init__(self) -> None:
        self.sleep_ms = 20.0
        # torch.cuda._sleep spins for a number of SM cycles: calibrate cycles per ms once.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # wake the clocks up
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        self.cycles_per_ms = 20_000_000 / max(start.elapsed_time(end), 1e-3)
        self._launched: float | None = None
        self._computed: torch.cuda.Event | None = None
        #: Host ms from the start of the last `time_ms`'s enqueue to its `mark_launched`
        #: (its whole enqueue when it marked nothing).
        self.launch_ms = 0.0
        #: GPU ms from the gate to the current stream's work before `mark_launched` (the
        #: forward's own compute; the whole run when nothing was marked).
        self.compute_ms = 0.0

    def mark_launched(self) -> None:
        """An enqueue's compute launches are all in; what follows only waits for copies
        (so a host paced by the driver shows apart from the waits at the end, and a
        forward slowed by the copies apart from copies that lag behind it)."""
        self._launched = time.perf_counter()
        self._computed = torch.cuda.Event(enable_timing=True)
        self._computed.record()

    def time_ms(self, enqueue: Callable[[], None]) -> tuple[float, float]:
        """(GPU ms, host ms of enqueue). `enqueue` must leave the current
        stream waiting for all of its work."""
        for _ in range(2):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(self.sleep_ms * self.cycles_per_ms))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._launched, self._computed = None, None
            t0 = time.perf_counter()
            enqueue()
            t1 = time.perf_counter()
            host_ms = (t1 - t0) * 1e3
            self.launch_ms = ((self._launched or t1) - t0) * 1e3
            end.record()
            end.synchronize()
            self.compute_ms = start.elapsed_time(self._computed or end)
            if host_ms < 0.8 * self.sleep_ms:
                return start.elapsed_time(end), host_ms
            if self.sleep_ms >= _MAX_SLEEP_MS:
                break  # host-bound (e.g. one DMA per page): report the rate as measured
            # The GPU caught up with Python: gate longer and retry (bounded: a queue full of
            # commands blocks the host on the gate itself).
            self.sleep_ms = min(_MAX_SLEEP_MS, host_ms * 2)
        return start.elapsed_time(end), host_ms


def _median_ms(gate: _Gate, enqueue: Callable[[], None], repeats: int = _REPEATS) -> tuple[float, float]:
    """Median (GPU ms, host ms) of `repeats` gated runs after one warm-up."""
    return _median_timings(gate, enqueue, repeats)[:2]


def _median_timings(
    gate: _Gate, enqueue: Callable[[], None], repeats: int = _REPEATS
) -> tuple[float, float, float, float]:
    """`_median_ms`, then the medians of the host ms and the GPU ms to the enqueue's
    `mark_launched`."""
    enqueue()  # warm-up (compilation, allocator, first-touch of index buffers)
    torch.cuda.synchronize()
    runs = [(*gate.time_ms(enqueue), gate.launch_ms, gate.compute_ms) for _ in range(repeats)]
    gpu, host, launch, compute = zip(*runs)
    return statistics.median(gpu), statistics.median(host), statistics.median(launch), statistics.median(compute)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def measure_peak(gate: _Gate, nbytes: int) -> dict[str, float]:
    """Contiguous pinned copies: D2H, H2D, and both at once on two streams."""
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]

    def on(pairs: list[tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]]) -> None:
        # Every stream waits on the gate first, then all copies are queued, then the
        # current stream waits on all: the copies of the pairs run at the same time.
        # (A first version waited stream by stream and so serialised the two directions.)
        for stream, _, _ in pairs:
            stream.wait_stream(torch.cuda.current_stream())
        for stream, dst, src in pairs:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream, _, _ in pairs:
            torch.cuda.current_stream().wait_stream(stream)

    d2h, _ = _median_ms(gate, lambda: on([(streams[0], host[0], dev[0])]))
    h2d, _ = _median_ms(gate, lambda: on([(streams[1], dev[1], host[1])]))
    both, _ = _median_ms(gate, lambda: on([(streams[0], host[0], dev[0]), (streams[1], dev[1], host[1])]))
    return {"peak_d2h_gbps": _gbps(nbytes, d2h), "peak_h2d_gbps": _gbps(nbytes, h2d), "peak_bidir_gbps": _gbps(2 * nbytes, both)}


def _pools(page_bytes: int, layers: int, pages: int, checksums: bool = False) -> tuple[Any, Any]:
    from hicache_cp.pools import DevicePool, HostPool

    layout = KVLayout.build(page_size=1, num_layers=layers, kv_bytes_per_token=page_bytes)
    dev = DevicePool(layout, pages, device="cuda")
    host = HostPool(layout, pages * layout.bytes_per_page, pin=True, checksums=checksums)
    host.wait_ready()
    return dev, host


def _page_sets(
    rng: np.random.Generator, count: int, n: int, dev_pages: int, host_pages: int, run: int = 1
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`count` (device, host) page sets of `n` distinct pages each, page 0 never used:
    random pages (`run` 1), or runs of `run` consecutive pages on both sides in random order."""
    def pick(pages: int) -> np.ndarray:
        if run == 1:
            return rng.permutation(np.arange(1, pages))[:n].astype(np.int64)
        starts = 1 + run * rng.permutation((pages - 1) // run)[: -(-n // run)]
        return (starts[:, None] + np.arange(run)).reshape(-1)[:n].astype(np.int64)

    return [(pick(dev_pages), pick(host_pages)) for _ in range(count)]


def measure_backend(
    gate: _Gate, engine: CopyEngine, sizes: list[int], page_bytes: int, rng: np.random.Generator, run: int = 1
) -> dict[str, dict[str, float]]:
    """D2H and H2D rate of one backend over page sets of each size (`_page_sets`),
    and the host time of each submission (one layer of one part) on the
    caller's thread: median and p99 over the gated batches plus
    `_SUBMIT_SAMPLES` more."""
    out: dict[str, dict[str, float]] = {}
    for n in sizes:
        reps = int(np.clip((256 << 20) // (n * page_bytes), 3, 50))
        sets = _page_sets(rng, reps, n, engine.device_pool.physical_pages, engine.host_pool.physical_pages, run)
        out[str(n)] = measure_sets(gate, engine, sets, page_bytes)
    return out


def measure_sets(
    gate: _Gate, engine: CopyEngine, sets: list[tuple[np.ndarray, np.ndarray]], page_bytes: int
) -> dict[str, float]:
    """D2H and H2D rate of copying every (device pages, host pages) set once
    per batch, and the host time of each submission (median, p99)."""
    total_pages = sum(len(d) for d, _ in sets)
    row: dict[str, float] = {}
    for label, backup in (("d2h", True), ("h2d", False)):
        row.update(_measure_direction(gate, engine, sets, page_bytes * total_pages, label, backup))
    return row


def _measure_direction(
    gate: _Gate, engine: CopyEngine, sets: list[tuple[np.ndarray, np.ndarray]], nbytes: int, label: str, backup: bool
) -> dict[str, float]:
    layers = engine.layout.part(Part.TARGET_KV).layer_ids
    submit_us: list[float] = []
    tickets: list[Any] = []
    batches = [0]
    # The cache's path: each op (page set) planned once, then one submission per layer.
    direction = Direction.D2H if backup else Direction.H2D
    plan_us: list[float] = []
    plans = []
    for d, h in sets:
        t0 = time.perf_counter()
        plans.append(engine.plan(direction, d, h))
        plan_us.append((time.perf_counter() - t0) * 1e6)
    parts = (Part.TARGET_KV,)

    def submit(i: int) -> Any:
        plan = plans[i % len(plans)]
        layer = layers[i % len(layers)]
        t0 = time.perf_counter()
        t = engine.submit_layer(plan, parts, layer)[0]
        if batches[0] > 1:  # the first batch is the warm-up
            submit_us.append((time.perf_counter() - t0) * 1e6)
        tickets.append(t)
        return t

    failed = [0, 0]  # FAILED, tickets retired

    def retire() -> None:
        """Count and drop the finished batch's tickets, as a server retires an op's at
        its commit: their events go back to the engine's pool for the next batch."""
        failed[0] += sum(t.query() is TicketState.FAILED for t in tickets)
        failed[1] += len(tickets)
        tickets.clear()

    def enqueue() -> None:
        retire()  # every batch starts after a synchronize (`_Gate.time_ms`, `_median_ms`)
        batches[0] += 1
        t = None
        for i in range(len(sets)):
            t = submit(i)
        assert t is not None
        t.make_compute_wait()

    ms, _ = _median_ms(gate, enqueue)
    torch.cuda.synchronize()
    retire()
    for i in range(_SUBMIT_SAMPLES):  # host time only: the GPU runs behind, unmeasured
        submit(i)
    tickets[-1].wait()
    torch.cuda.synchronize()
    retire()
    if failed[0]:
        raise RuntimeError(f"{failed[0]} of {failed[1]} {label} copies FAILED")
    return {
        f"{label}_gbps": _gbps(nbytes, ms),
        f"{label}_submit_us": float(np.median(submit_us)),
        f"{label}_submit_us_p99": float(np.percentile(submit_us, 99)),
        f"{label}_submit_samples": len(submit_us),
        f"{label}_plan_us": float(np.median(plan_us)),
    }


def measure_alloc_runs(gate: _Gate, path: Path, backends: list[str], page_bytes: int) -> dict[str, Any]:
    """Copies of the page lists each allocator of a bench-alloc run actually
    handed out (its `sample_runs`: the same reservations for every allocator),
    host side as given, device side contiguous: what contiguity buys in
    descriptors, submit time and GB/s, per backend."""
    try:
        unit = json.loads(path.read_text())["units"][0]
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise InputError(f"--alloc-runs {path}: not a bench-alloc result ({exc})") from None
    reservations = {
        name: [np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in runs]) for runs in a["sample_runs"]]
        for name, a in unit["allocators"].items() if a.get("sample_runs")
    }  # fmt: skip
    pages = max(int(h.max()) for hs in reservations.values() for h in hs) + 1
    largest = max(len(h) for hs in reservations.values() for h in hs)
    dev, host = _pools(page_bytes, 2, max(pages, largest + 1))
    out: dict[str, Any] = {"source": str(path), "source_commit": None, "pages": pages, "allocators": {}}
    try:
        out["source_commit"] = json.loads(path.read_text()).get("commit")
    except ValueError:
        pass
    for name, hosts in reservations.items():
        sets = [(np.arange(1, len(h) + 1, dtype=np.int64), h) for h in hosts]
        runs = [len(a) for a in unit["allocators"][name]["sample_runs"]]
        entry: dict[str, Any] = {"runs_per_reserve": float(np.mean(runs)), "pages_per_reserve": float(np.mean([len(h) for h in hosts]))}
        for backend in backends:
            engine = _make(backend, dev, host)
            try:
                entry[backend] = measure_sets(gate, engine, sets, page_bytes)
            finally:
                engine.close()
        out["allocators"][name] = entry
        _progress(f"alloc runs {name}: {json.dumps(entry)}")
    host.close()
    return out


def warm_up(engine: CopyEngine, sizes: list[int], rng: np.random.Generator, seconds: float = _WARMUP_S) -> None:
    """Submit copies of every size both ways for `seconds`, unmeasured; then close `engine`."""
    sets = [s for n in sizes for s in _page_sets(rng, 2, n, engine.device_pool.physical_pages, engine.host_pool.physical_pages)]
    end, i = time.perf_counter() + seconds, 0
    try:
        while time.perf_counter() < end:
            d, h = sets[i % len(sets)]
            t = engine.submit_backup(Part.TARGET_KV, 0, d, h) if i % 2 else engine.submit_load(Part.TARGET_KV, 0, h, d)
            i += 1
            if i % 16 == 0:
                t.wait()
        torch.cuda.synchronize()
    finally:
        engine.close()


def measure_bidir(gate: _Gate, engine: CopyEngine, n: int, page_bytes: int, rng: np.random.Generator) -> float:
    """Backups (layer 0) and loads (layer 1) at once with one engine: GB/s total."""
    reps = int(np.clip((256 << 20) // (n * page_bytes), 3, 50))
    sets = _page_sets(rng, reps, n, engine.device_pool.physical_pages, engine.host_pool.physical_pages)

    plans = [(engine.plan(Direction.D2H, d, h), engine.plan(Direction.H2D, d, h)) for d, h in sets]
    parts = (Part.TARGET_KV,)

    def enqueue() -> None:
        tickets = []
        for backup, load in plans:
            tickets.append(engine.submit_layer(backup, parts, 0)[0])
            tickets.append(engine.submit_layer(load, parts, 1)[0])
        tickets[-2].make_compute_wait()
        tickets[-1].make_compute_wait()

    ms, _ = _median_ms(gate, enqueue)
    return _gbps(2 * reps * n * page_bytes, ms)


def measure_overlap(gate: _Gate, engine: CopyEngine, n: int, rng: np.random.Generator, run: int = 1) -> dict[str, float]:
    """Per-layer load overlap: exposed load time as a fraction of copy-only time
    (pages scattered, or in runs of `run` on both sides); each op planned once."""
    layers = engine.layout.part(Part.TARGET_KV).layer_ids
    d, h = _page_sets(rng, 1, n, engine.device_pool.physical_pages, engine.host_pool.physical_pages, run)[0]
    load_plan, backup_plan = engine.plan(Direction.H2D, d, h), engine.plan(Direction.D2H, d, h)
    parts = (Part.TARGET_KV,)

    def backup(layer: int) -> Any:
        return engine.submit_layer(backup_plan, parts, layer)[0]

    def loads() -> list[Any]:  # every layer at once, as the cache's load_back submits them
        return [tickets[0] for tickets in engine.submit_layers(load_plan, [(parts, layer) for layer in layers])]

    copy_ms, _ = _median_ms(gate, lambda: loads()[-1].make_compute_wait())
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    mm_ms, _ = _median_ms(gate, lambda: [torch.matmul(a, b, out=c) for _ in range(20)])
    per_layer = max(1, math.ceil(copy_ms / len(layers) / (mm_ms / 20)))  # compute >= copy per layer

    checked = engine.verify is not Verify.OFF
    if checked:  # a checked backup of the same pages first: the loads' checks compare with its checksums
        for t in [backup(x) for x in layers]:
            t.wait()

    def compute(tickets: list[Any] | None) -> None:
        for i in range(len(layers)):
            if tickets is not None:
                tickets[i].make_compute_wait()
            for _ in range(per_layer):
                torch.matmul(a, b, out=c)
        if tickets is not None and checked:  # the poll after the forward: the loads' checks launch
            gate.mark_launched()
            for t in tickets:
                t.query()

    compute_ms, compute_host_ms = _median_ms(gate, lambda: compute(None))
    with_ms, with_host_ms = _median_ms(gate, lambda: compute(loads()))

    def with_backups() -> None:  # each layer's backup right after its compute, all awaited at the end
        tickets = []
        for layer in layers:
            for _ in range(per_layer):
                torch.matmul(a, b, out=c)
            tickets.append(backup(layer))
        gate.mark_launched()
        for t in tickets:
            t.make_compute_wait()

    backup_copy_ms, _ = _median_ms(gate, lambda: [backup(x) for x in layers][-1].make_compute_wait())
    backups_ms, backups_host_ms, backups_launch_ms, backups_compute_ms = _median_timings(gate, with_backups)
    return {
        "copy_ms": copy_ms, "compute_ms": compute_ms, "with_loads_ms": with_ms, "matmuls_per_layer": per_layer,
        # compute's headroom over the copy (matmuls come whole: 1.0-1.25) and the floor, one
        # layer's copy: both bound what any backend can show here.
        "compute_over_copy": compute_ms / copy_ms, "floor_fraction": 1 / len(layers), "layers": len(layers), "exposed_load_fraction": max(0.0, (with_ms - compute_ms) / copy_ms),
        "backup_copy_ms": backup_copy_ms, "with_backups_ms": backups_ms,
        "exposed_backup_fraction": max(0.0, (backups_ms - compute_ms) / backup_copy_ms),
        # The host's time to enqueue each forward: past the gate's sleep (`gate_ms`) the GPU
        # ran while the host was still enqueueing, and what the host lost (a launch waiting
        # for the driver behind a long DMA call) is in the exposure, as in a server.
        "compute_host_ms": compute_host_ms, "with_loads_host_ms": with_host_ms,
        "with_backups_host_ms": backups_host_ms, "gate_ms": gate.sleep_ms,
        # ... of which the forward's launches and backup submissions (the rest waits for the
        # issue worker): past the gate, the driver held the forward's launches.
        "with_backups_launch_ms": backups_launch_ms,
        # The forward's own GPU time beside the backups, to its last matmul: above
        # `compute_ms`, the copies slowed the compute; at it, the exposure is copies that
        # lag behind the forward.
        "with_backups_compute_ms": backups_compute_ms,
        "verify_restores": engine.verify.value,
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table; write JSON if asked. Returns the exit status."""
    if not torch.cuda.is_available():
        print("bench-io: no CUDA device (torch.cuda.is_available() is False); this benchmark needs a GPU", file=sys.stderr)
        return 2
    global _VERIFY
    _VERIFY = Verify(getattr(args, "verify", "off"))
    per_sm = getattr(args, "checksum_programs_per_sm", None)
    if per_sm is not None and per_sm < 0:
        raise InputError(f"--checksum-programs-per-sm must be >= 0 (0: a program a page), got {per_sm}")
    if per_sm is not None:
        checksum_gpu.PROGRAMS_PER_SM = per_sm or None  # read when each engine's checks are built
    sizes = [int(x) for x in str(args.pages).split(",") if x]
    names = [x for x in str(args.backends).split(",") if x]
    page_bytes = int(args.page_bytes)
    rng = np.random.default_rng(0)
    gate = _Gate()
    result: dict[str, Any] = {
        "command": command_line("bench-io"),
        "verify_restores": _VERIFY.value,
        "checksum_programs_per_sm": checksum_gpu.PROGRAMS_PER_SM,
        "commit": git_commit(),
        "machine": torch.cuda.get_device_name(),
        "host": machine(),
        "page_bytes": page_bytes,
    }
    def save() -> None:  # after every step, with the targets so far: a run cut short still says what it met
        if "backends" in result:
            result["targets"] = _targets(result)
            rows = result["backends"].get(result["default_backend"], {})
            result["default_numbers"] = {n: rows[n] for n in _DEFAULT_SIZES if n in rows}
        if args.json is not None:
            write_json(args.json, result)

    result.update(measure_peak(gate, int(args.peak_mib) << 20))
    _progress(f"peak D2H {result['peak_d2h_gbps']:.1f} H2D {result['peak_h2d_gbps']:.1f} both {result['peak_bidir_gbps']:.1f} GB/s")
    save()
    torch.cuda.empty_cache()
    if args.alloc_runs is not None:
        result["alloc_runs"] = measure_alloc_runs(gate, args.alloc_runs, ["hybrid", "direct"], page_bytes)
        save()
        return 0
    dev, host = _pools(page_bytes, 2, 2 * max(sizes) + 1)
    default = default_backend(dev)
    result["default_backend"] = default
    unknown = sorted((set(names) | {x for x in str(args.runs_backends).split(",") if x}) - set(VARIANTS))
    if unknown:
        print(f"bench-io: unknown backend(s) {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    order = sorted(names, key=lambda x: x != default)  # the default first: it matters most
    warm_up(_make(default, dev, host), sizes, rng)
    result["backends"] = {}
    for name in order:
        try:
            engine = _make(name, dev, host)
            result["backends"][name] = measure_backend(gate, engine, sizes, page_bytes, rng)
            result["backends"][name]["engine"] = _describe(engine)
            engine.close()
        except Exception as exc:  # noqa: BLE001 - one broken backend must not hide the others
            result["backends"][name] = {"error": repr(exc)}
        _progress(f"{name}: {json.dumps(result['backends'][name])}")
        save()
        try:  # every backend's bidirectional rate; the default's is the headline number
            engine = _make(name, dev, host)
            n = 1024 if max(sizes) >= 1024 else max(sizes)
            result.setdefault("bidir_by_backend", {})[name] = measure_bidir(gate, engine, n, page_bytes, rng)
            engine.close()
        except Exception as exc:  # noqa: BLE001
            result.setdefault("bidir_by_backend", {})[name] = repr(exc)
        if name == default and isinstance(result["bidir_by_backend"][name], float):
            result["bidir_gbps"] = result["bidir_by_backend"][name]
            result["bidir_ratio"] = result["bidir_gbps"] / result["peak_bidir_gbps"]
        _progress(f"bidir {name}: {result['bidir_by_backend'][name]}")
        save()
    result["runs_pattern"] = {"run_pages": int(args.run_pages)}
    for name in [x for x in str(args.runs_backends).split(",") if x]:
        try:
            engine = _make(name, dev, host)
            rows = measure_backend(gate, engine, sizes, page_bytes, rng, run=int(args.run_pages))
            rows["engine"] = _describe(engine)
            engine.close()
        except Exception as exc:  # noqa: BLE001
            rows = {"error": repr(exc)}
        result["runs_pattern"][name] = rows
        _progress(f"{name} (runs of {args.run_pages}): {json.dumps(rows)}")
        save()
    fractions = [float(x) for x in str(args.kernel_sm_fractions).split(",") if x]
    result["kernel_sm_sweep"] = {}
    for f in fractions:
        try:
            engine = make_engine("kernel", dev, host, sm_fraction=f)
            result["kernel_sm_sweep"][str(f)] = measure_backend(gate, engine, [n for n in sizes if n <= 1024], page_bytes, rng)
            result["kernel_sm_sweep"][str(f)]["engine"] = _describe(engine)
            engine.close()
        except Exception as exc:  # noqa: BLE001
            result["kernel_sm_sweep"][str(f)] = {"error": repr(exc)}
        _progress(f"kernel sm_fraction {f}: {json.dumps(result['kernel_sm_sweep'][str(f)])}")
        save()
    host.close()
    del dev, host
    torch.cuda.empty_cache()
    odev, ohost = _pools(page_bytes, int(args.overlap_layers), 2 * int(args.overlap_pages) + 1)
    result["overlap"] = {}
    # Every variant and every grid cap of the sweep, beside the same forward.
    makers = [(name, lambda name=name, d=odev, h=ohost: _make(name, d, h)) for name in order]
    makers += [(f"kernel@{f}", lambda f=f, d=odev, h=ohost: make_engine("kernel", d, h, sm_fraction=f)) for f in fractions]
    for label, maker in makers:
        try:
            engine = maker()
            result["overlap"][label] = measure_overlap(gate, engine, int(args.overlap_pages), rng)
            engine.close()
        except Exception as exc:  # noqa: BLE001
            result["overlap"][label] = {"error": repr(exc)}
        _progress(f"overlap {label}: {json.dumps(result['overlap'][label])}")
        if label == default:
            result["exposed_load_fraction"] = result["overlap"][label].get("exposed_load_fraction")
            result["exposed_backup_fraction"] = result["overlap"][label].get("exposed_backup_fraction")
        save()
    ohost.close()
    del odev, ohost, makers
    torch.cuda.empty_cache()
    labels = [default, *[x for x in str(args.exposure_backends).split(",") if x and x != default]]
    result["exposure_by_backend"] = measure_exposure_rows(
        gate, labels, [int(x) for x in str(args.exposure_pages).split(",") if x], page_bytes, int(args.run_pages), rng, save,
        result,
    )
    result["exposure"] = result["exposure_by_backend"][default]
    save()
    _print_table(result)
    return 0


def measure_exposure_rows(
    gate: _Gate, labels: list[str], sizes: list[int], page_bytes: int, run: int, rng: np.random.Generator,
    save: Callable[[], None], result: dict[str, Any],
) -> dict[str, dict[str, dict[str, Any]]]:
    """The exposure of each variant in `labels` at each page count, scattered and in
    runs of `run` pages (allocator-shaped): label -> pattern -> pages -> row. The
    variants of one page count share pools of `_EXPOSURE_LAYERS` layers."""
    out: dict[str, dict[str, dict[str, Any]]] = {label: {"scattered": {}, "runs": {}} for label in labels}
    result["exposure_by_backend"] = out
    for n in sizes:
        dev, host = _pools(page_bytes, _EXPOSURE_LAYERS, n + run + 1, checksums=_VERIFY is not Verify.OFF)
        try:
            for label in labels:
                for pattern, r in (("scattered", 1), ("runs", run)):
                    try:
                        engine = _make(label, dev, host)
                        engine.verify = _VERIFY  # the exposure rows run with the restore checks of `--verify`
                        out[label][pattern][str(n)] = measure_overlap(gate, engine, n, rng, r)
                        engine.close()
                    except Exception as exc:  # noqa: BLE001
                        out[label][pattern][str(n)] = {"error": repr(exc)}
                    _progress(f"exposure {label} {pattern} {n}: {json.dumps(out[label][pattern][str(n)])}")
                    save()
        finally:
            host.close()
            del dev, host
            torch.cuda.empty_cache()
    return out


def _make(label: str, dev: Any, host: Any) -> CopyEngine:
    name, options = VARIANTS[label]
    return make_engine(name, dev, host, **options)


def _describe(engine: CopyEngine) -> dict[str, Any]:
    """What ran: the backend and its options (batched DMA, kernel mode, grid, DMA-routed copies)."""
    keys = ("name", "batch", "mode", "max_ctas", "unroll", "tail", "dma_runs", "worker_above", "chunks", "wholes", "counts")
    def plain(value: Any) -> Any:  # enum keys (chunks by Direction) as their values
        return {getattr(k, "value", k): v for k, v in value.items()} if isinstance(value, dict) else value

    return {k: plain(getattr(engine, k)) for k in keys if hasattr(engine, k)}


def _progress(line: str) -> None:
    print(f"[bench-io] {line}", flush=True)


def _measured_rows(r: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(label, rows by page count) of every backend, then of the kernel sweep."""
    sweep = [(f"kernel@{f}", rows) for f, rows in r.get("kernel_sm_sweep", {}).items()]
    return [*r["backends"].items(), *sweep]


def _targets(r: dict[str, Any]) -> dict[str, Any]:
    """Which targets each backend meets (ratios against the peak of the direction)."""
    out: dict[str, Any] = {}
    for name, rows in _measured_rows(r):
        if "error" in rows:
            out[name] = rows["error"]
            continue
        met = {}
        for n, row in rows.items():
            if n == "engine":
                continue
            need = TARGETS["scattered_ratio_64"] if int(n) < 1024 else TARGETS["scattered_ratio_1024plus"]
            for d in ("d2h", "h2d"):
                ratio = row[f"{d}_gbps"] / r[f"peak_{d}_gbps"]
                row[f"{d}_ratio"] = ratio
                met[f"{d}@{n}"] = ratio >= need
                budget = TARGETS.get(f"submit_us_{n}")
                if budget is not None:
                    met[f"{d}_submit@{n}"] = row[f"{d}_submit_us"] <= budget
        out[name] = met
    for name, rows in r.get("runs_pattern", {}).items():
        if name == "run_pages" or "error" in rows:
            continue
        met = {}
        for n, row in rows.items():
            if n == "engine":
                continue
            need = TARGETS["runs_ratio_64"] if int(n) < 1024 else TARGETS["runs_ratio_1024plus"]
            for d in ("d2h", "h2d"):
                row[f"{d}_ratio"] = row[f"{d}_gbps"] / r[f"peak_{d}_gbps"]
                met[f"{d}@{n}"] = row[f"{d}_ratio"] >= need
                budget = TARGETS.get(f"submit_us_{n}")
                if budget is not None:
                    met[f"{d}_submit@{n}"] = row[f"{d}_submit_us"] <= budget
        out[f"{name}@runs"] = met
    out["bidir"] = (r.get("bidir_ratio") or 0.0) >= TARGETS["bidir_ratio"]
    exposure = {}
    for pattern, rows in r.get("exposure", {}).items():
        for n, row in rows.items():
            if "error" not in row:
                exposure[f"{pattern}@{n}"] = (
                    row["exposed_load_fraction"] <= TARGETS["exposed_load_fraction"]
                    and row["exposed_backup_fraction"] <= TARGETS["exposed_backup_fraction"]
                )
    x, y = r.get("exposed_load_fraction"), r.get("exposed_backup_fraction")
    exposure["overlap@default"] = (
        x is not None and y is not None and x <= TARGETS["exposed_load_fraction"] and y <= TARGETS["exposed_backup_fraction"]
    )
    out["exposure"] = exposure
    return out


def _print_table(r: dict[str, Any]) -> None:
    print(f"bench-io on {r['machine']}, page {r['page_bytes']} B")
    print(f"peak contiguous: D2H {r['peak_d2h_gbps']:.1f} GB/s, H2D {r['peak_h2d_gbps']:.1f} GB/s, both {r['peak_bidir_gbps']:.1f} GB/s")
    print("submit: host time of one layer's submission on the caller's thread, median/p99 (us)")
    print(f"{'variant':<15}{'pages':>7}{'D2H GB/s':>10}{'ratio':>7}{'submit':>13}{'H2D GB/s':>10}{'ratio':>7}{'submit':>13}")
    rows_of = [*_measured_rows(r), *[(f"{k}@runs", v) for k, v in r.get("runs_pattern", {}).items() if k != "run_pages"]]
    for name, rows in rows_of:
        if "error" in rows:
            print(f"{name:<15} failed: {rows['error']}")
            continue
        for n, row in rows.items():
            if n == "engine":
                continue
            print(
                f"{name:<15}{n:>7}{row['d2h_gbps']:>10.1f}{row['d2h_ratio']:>7.2f}"
                f"{row['d2h_submit_us']:>7.0f}/{row['d2h_submit_us_p99']:<5.0f}{row['h2d_gbps']:>10.1f}{row['h2d_ratio']:>7.2f}"
                f"{row['h2d_submit_us']:>7.0f}/{row['h2d_submit_us_p99']:<5.0f}"
            )
    if "bidir_gbps" in r:
        print(f"engine bidir ({r['default_backend']}): {r['bidir_gbps']:.1f} GB/s, ratio {r['bidir_ratio']:.2f}")
    for name, o in r["overlap"].items():
        if "error" in o:
            print(f"overlap {name:<14} failed: {o['error']}")
            continue
        print(
            f"overlap {name:<14} copy {o['copy_ms']:.2f} ms, compute {o['compute_ms']:.2f} ms, "
            f"with loads {o['with_loads_ms']:.2f} ms -> exposed {o['exposed_load_fraction']:.3f}; "
            f"with backups {o['with_backups_ms']:.2f} ms (compute {o.get('with_backups_compute_ms', 0):.2f})"
            f" -> exposed {o['exposed_backup_fraction']:.3f}"
        )
    by_backend = r.get("exposure_by_backend") or {r["default_backend"]: r.get("exposure", {})}
    for label, patterns in by_backend.items():
        for pattern, rows in patterns.items():
            for n, o in rows.items():
                if "error" in o:
                    print(f"exposure {label} {pattern} {n}: failed: {o['error']}")
                    continue
                print(
                    f"exposure {label:<17} {pattern:<9} {n:>5} pages x {o['layers']} layers: "
                    f"load {o['exposed_load_fraction']:.3f}, backup {o['exposed_backup_fraction']:.3f}"
                    f" (host {o.get('with_loads_host_ms', 0):.0f}/{o.get('with_backups_host_ms', 0):.0f} ms,"
                    f" backups' launches {o.get('with_backups_launch_ms', 0):.0f}, gate {o.get('gate_ms', 0):.0f};"
                    f" compute {o.get('compute_ms', 0):.2f} ms alone, {o.get('with_backups_compute_ms', 0):.2f} beside backups)"
                )
    print(f"targets: {json.dumps(r['targets'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache-cp bench-io", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
