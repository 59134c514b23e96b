"""`hicache-cp bench-sglang`: hicache-cp against SGLang's own HiCache, in one process on one GPU.

The question: at the same device pages and the same host bytes, on the same
request stream, does `--radix-cache-backend hicache-cp` serve at least as
many prompt tokens from host memory as SGLang 0.5.23's
`--enable-hierarchical-cache`, with no more scheduler-thread time in the tree
cache, less copy time exposed beside a compute-bound forward, and no wrong
byte?

Each backend runs in its own `sglang_race_server.RaceServer` (SGLang's pools
on the device, its scheduler's functions and calls, the tree cache built as
SGLang builds it, a forward that writes and checks every byte on the device),
one after the other in this process, on the same request sequence: a
Mooncake-format trace (default: the shared one) and the embedded workload,
`--tokens-per-block` tokens per trace block, one request at a time in
arrival order, page 64, chunked prefill of 4,096 tokens, no settling between
requests (as a server runs). Backends: `radix` (SGLang's device tree only),
`hicache-cp`, `sglang-hicache` (SGLang's `UnifiedRadixCache`,
`HybridCacheController`, MLA or DSA host pools and its JIT kernels; io
backend `kernel`, layout `page_first` by default). A backend that fails (a
kernel SGLang cannot run here, a construction error) is recorded with its
error and where, and the others run.

Reported per backend and workload:

    device / host / computed   prompt tokens served from the device tree, loaded from
                               host memory, and computed (at each request's admission)
    h2d / d2h bytes            hicache-cp's counted copies; SGLang's acks' num_bytes
    tree-cache ms / request    the scheduler thread's time in the tree cache's calls and
                               in the layer counter's hooks (waits included), outermost
                               calls only, summed over the run, over the requests
    exposed load / backup      each forward's GPU time minus the time the same forward
                               takes alone (KV writes and compute for its new tokens, fitted
                               from a calibration on the empty pool), summed over forwards that
                               waited on a load (load) and over the others (backup:
                               copies in flight beside them); as fractions, over the
                               time those bytes take at the link's contiguous pinned
                               peak (measured here)
    mismatched bytes           every prefix byte each layer reads, checked on the device
    tree core                  SGLang's (RustUnifiedTreeCore or UnifiedTreeCore)

JSON (commit, machine, command) and a Markdown table. CPU: `--device cpu`
runs `radix` and `hicache-cp` (the cpu engine) and records how far SGLang's
HiCache constructs (its host pool registers memory with CUDA).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import pstats
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache_cp import Config, ConfigError
from hicache_cp.config import STRICT_ENV
from hicache_harness import checks
from hicache_harness.bench.sglang_race_server import BACKENDS, POOLS, RaceServer, RaceSpec
from hicache_harness.errors import InputError
from hicache_harness.outputs import write_json
from hicache_harness.provenance import command_line, git_commit, machine
from hicache_harness.trace import TraceRequest, load_trace, request_tokens
from hicache_harness.workload import default_workload

_REPO = Path(__file__).resolve().parents[2]
#: Where the shared trace is looked for (first found): a device call's carried copy, the
#: shared folder beside the checkout, the workplace's shared folder.
TRACES = (_REPO / ".devdata" / "synthetic_trace.jsonl", _REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl",
          Path("/work/shared/traces/synthetic_trace.jsonl"))  # fmt: skip
CALIBRATION_TOKENS = (0, 1024, 4096)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, help="Mooncake-format trace (default: the shared one, see TRACES)")
    p.add_argument("--workloads", nargs="+", default=["trace", "embedded"], choices=["trace", "embedded"])
    p.add_argument("--limit", type=int, default=300, help="requests of each workload (default 300)")
    p.add_argument("--tokens-per-block", type=int, default=64, help="tokens per trace block (default 64: one page)")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--pools", nargs="+", default=["mla", "dsa"], choices=POOLS,
                   help="mha needs hicache-cp's MHA pools (SGLang's own runs its JIT kernels on them)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when there is one)")
    p.add_argument("--device-pages", type=int, default=256, help="SGLang's KV pool in pages (raised to fit the longest prompt)")
    p.add_argument("--layers", type=int, default=61, help="MLA layers (default 61, DeepSeek-V3's)")
    p.add_argument("--host-ratio", type=float, default=2.0, help="SGLang's --hicache-ratio; hicache-cp gets the same bytes")
    p.add_argument("--sglang-layout", default="page_first", choices=["page_first", "layer_first"])
    p.add_argument("--tree-core", default="rust", choices=["rust", "python"], help="SGLang's tree core (python if rust fails)")
    p.add_argument("--matmuls", type=int, default=2, help="per layer, of [dim, dim] bf16 (the forward's compute)")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--no-check", action="store_true", help="do not check bytes")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="cProfile each backend's serving into DIR/<workload>-<pools>-<backend>.prof, with its "
                        "top functions as text beside it (.txt; start-up and calibration left out; Python 3.12's "
                        "cProfile sees every thread)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the calls inside the tree cache (each backend's copy engine or controller, "
                        "its cache's poll and hooks), at any depth, as the row's inner_calls")
    p.add_argument("--setting", action="append", default=[], metavar="FIELD=VALUE",
                   help="a field of hicache-cp's Config for its tree cache (repeatable), as HICACHE_<FIELD> takes it, "
                        "e.g. backup_submits_per_forward=4")
    p.add_argument("--tables", type=Path, metavar="JSON", help="print the tables of an existing result and exit")
    p.add_argument("--switch-interval", type=float, metavar="S",
                   help="the interpreter's thread switch interval while serving (sys.setswitchinterval; "
                        "default Python's 0.005): how much the scheduler thread waits for the GIL")
    p.add_argument("--io-option", action="append", default=[], metavar="KEY=INT",
                   help="an option of hicache-cp's copy engine (repeatable), e.g. hook_worker_above=1000000: "
                        "backups issued on the scheduler thread instead of the issue worker")


def _write_profile_text(profiler: cProfile.Profile, path: Path, top: int = 80) -> None:
    """The profile's `top` functions by own time, then by cumulative time, as text (a
    device run's files come back only as text)."""
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(top)
    path.write_text(out.getvalue())


def run_backend(
    spec: RaceSpec, requests: Sequence[TraceRequest], *, tokens_per_block: int, workdir: Path, profile: Path | None = None,
    switch_interval: float | None = None, io_options: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Serve `requests` through one backend; its row (see the module docstring). `profile`:
    where to write a cProfile of the serving; `switch_interval`: the interpreter's while
    serving; `io_options`: hicache-cp's copy engine options."""
    row: dict[str, Any] = {"backend": spec.backend, "pools": spec.pools}
    if switch_interval is not None:
        row["switch_interval_s"] = switch_interval
    if io_options and spec.backend == "hicache-cp":
        row["io_options"] = io_options
    if spec.settings and spec.backend == "hicache-cp":
        row["settings"] = dict(spec.settings)
    try:
        with _engine_options(io_options if spec.backend == "hicache-cp" else None):
            server = _build(spec, workdir, row)
    except Exception as exc:  # noqa: BLE001 - the outcome is the record
        return {**row, **failure_record(exc, "construct")}
    default_interval = sys.getswitchinterval()
    try:
        room = (spec.device_pages - 2) * spec.page_size  # the empty pool's slots past the padding page
        calibration = server.forward.calibrate(sorted({min(n, room, spec.chunk_tokens) for n in CALIBRATION_TOKENS}))
        profiler = cProfile.Profile() if profile is not None else None
        if profiler is not None:
            profiler.enable()
        try:
            if switch_interval is not None:
                sys.setswitchinterval(switch_interval)
            prompt = _serve(server, requests, tokens_per_block, row)
        finally:
            sys.setswitchinterval(default_interval)
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(profile)
                _write_profile_text(profiler, profile.with_suffix(".txt"))
        row.update(_measure(server, prompt, calibration))
    except Exception as exc:  # noqa: BLE001 - the outcome is the record, with what was served
        row.update(failure_record(exc, "serve"))
    finally:
        server.close()
    return row


@contextlib.contextmanager
def _engine_options(options: dict[str, int] | None) -> Iterator[None]:
    """While building a server: every HiCache's copy engine made with `options` too."""
    if not options:
        yield
        return
    from hicache_cp.cache import hicache

    real = hicache.make_engine
    hicache.make_engine = functools.partial(real, **options)
    try:
        yield
    finally:
        hicache.make_engine = real


def _build(spec: RaceSpec, workdir: Path, row: dict[str, Any]) -> RaceServer:
    """The backend's server; SGLang's HiCache falls back to its Python tree core when the Rust one fails."""
    try:
        return RaceServer(spec, workdir)
    except Exception as exc:  # noqa: BLE001 - recorded, retried with the Python core
        if spec.backend != "sglang-hicache" or spec.tree_core == "python":
            raise
        row["rust_tree_core_error"] = failure_record(exc, "construct")["error"]
        from dataclasses import replace

        return RaceServer(replace(spec, tree_core="python"), workdir / "python-core")


def _serve(server: RaceServer, requests: Sequence[TraceRequest], tokens_per_block: int, row: dict[str, Any]) -> int:
    prompt = 0
    t0 = time.perf_counter()
    row["requests_served"] = 0
    for i, req in enumerate(requests):
        tokens = request_tokens(req, tokens_per_block)
        if len(tokens) < 2:
            continue
        prompt += len(tokens)
        server.submit(tokens.tolist(), rid=f"q{i}")
        server.run_until_idle()
        row["requests_served"] += 1
    server.settle()
    row["wall_s"] = time.perf_counter() - t0
    return prompt


def _measure(server: RaceServer, prompt_tokens: int, calibration: list[tuple[int, float]]) -> dict[str, Any]:
    fwd = server.forward
    requests = max(1, len(server.admissions))
    h2d, d2h = server.bytes_moved()
    times = fwd.forward_ms()
    slope, intercept = np.polyfit([n for n, _ in calibration], [ms for _, ms in calibration], 1)
    exposed = {"load": 0.0, "backup": 0.0}
    waited = 0
    for rec, ms in zip(fwd.stats.forwards, times, strict=True):
        key = "load" if rec.had_load else "backup"
        waited += rec.had_load
        exposed[key] += max(0.0, ms - (intercept + slope * rec.new_tokens))
    mismatches = fwd.mismatches()
    clock = server.clock
    calls = {name: {**_stats(xs), "cpu_ms": clock.cpu_seconds[name] * 1e3} for name, xs in clock.seconds.items() if xs}
    return {
        "requests": len(server.admissions),
        "prompt_tokens": prompt_tokens,
        "device_hit_tokens": sum(d for d, _ in server.admissions.values()),
        "host_hit_tokens": sum(h for _, h in server.admissions.values()),
        "computed_tokens": fwd.stats.computed_tokens,
        "bytes_h2d": h2d, "bytes_d2h": d2h,
        "host_pool_bytes": server.host_pool_bytes(), "host_bytes_spec": server.race.host_bytes,
        "device_pages": server.race.device_pages,
        "checked_bytes": fwd.stats.checked_bytes,
        "mismatched_bytes": sum(mismatches.values()),
        "mismatched_requests": sorted(mismatches)[:10],
        "tree_cache_ms_per_request": clock.total() * 1e3 / requests,
        "tree_cache_cpu_ms_per_request": sum(clock.cpu_seconds.values()) * 1e3 / requests,
        "hook_ms_per_request": sum(c["total_ms"] for k, c in calls.items() if k.startswith("hook.")) / requests,
        "calls": calls,
        "inner_calls": {name: {**_stats(xs), "cpu_ms": clock.inner_cpu_seconds[name] * 1e3}
                        for name, xs in clock.inner_seconds.items() if xs},
        "forwards": len(times), "forwards_with_load": waited,
        "forward_ms_total": float(sum(times)),
        "calibration": [{"new_tokens": n, "ms": ms} for n, ms in calibration],
        "exposed_load_ms": exposed["load"], "exposed_backup_ms": exposed["backup"],
        "tree_core": server.tree_core(),
        "idle_rounds": server.idle_rounds,
        "sglang_layout": server.race.sglang_layout if server.race.backend == "sglang-hicache" else None,
        "plugin": vars(server.tree_cache.stats) if server.race.backend == "hicache-cp" else None,
    }  # fmt: skip


def _stats(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"calls": len(xs), "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)),
            "total_ms": float(a.sum() / 1e3)}  # fmt: skip


def failure_record(exc: BaseException, phase: str) -> dict[str, Any]:
    """What failed and where: the error, the innermost SGLang (or sgl_kernel stand-in) frame, the phase."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)
                  if "sglang" in f.filename or "sgl_kernel" in f.filename), "")  # fmt: skip
    return {"error": f"{type(exc).__name__}: {exc}"[:600], "at": where, "phase": phase,
            "traceback": traceback.format_exception(exc)[-6:]}  # fmt: skip


def link_peaks() -> dict[str, float] | None:
    """The contiguous pinned copy rate each way (GB/s) on this GPU, for the exposure fractions."""
    if not torch.cuda.is_available():
        return None
    from hicache_harness.bench.io import _Gate, measure_peak

    return measure_peak(_Gate(), 256 << 20)


def add_fractions(row: dict[str, Any], peaks: dict[str, float] | None) -> None:
    """Exposed copy time over the time the row's bytes take at the link's peak."""
    if not peaks or "exposed_load_ms" not in row:
        return
    load_ms = row["bytes_h2d"] / (peaks["peak_h2d_gbps"] * 1e9) * 1e3
    backup_ms = row["bytes_d2h"] / (peaks["peak_d2h_gbps"] * 1e9) * 1e3
    row["load_link_ms"], row["backup_link_ms"] = load_ms, backup_ms
    row["exposed_load_fraction"] = row["exposed_load_ms"] / load_ms if load_ms else None
    row["exposed_backup_fraction"] = row["exposed_backup_ms"] / backup_ms if backup_ms else None


def race(requests: Sequence[TraceRequest], args: argparse.Namespace, device: str, peaks: dict[str, float] | None,
         workdir: Path) -> list[dict[str, Any]]:  # fmt: skip
    """Every pool kind x backend on one request sequence."""
    longest = max(len(request_tokens(r, args.tokens_per_block)) for r in requests)
    # SGLang admits no prompt larger than its pool: the pool holds at least 1.25 of the longest.
    pages = max(args.device_pages, -(-longest * 5 // 4 // 64) + 2)
    settings = parse_settings(args)
    rows = []
    for pools in args.pools:
        for backend in args.backends:
            spec = RaceSpec(backend=backend, pools=pools, device=device, device_pages=pages, layers=args.layers,
                            host_ratio=args.host_ratio, sglang_layout=args.sglang_layout, tree_core=args.tree_core,
                            matmuls=args.matmuls, dim=args.dim, check_bytes=not args.no_check,
                            breakdown=args.breakdown, settings=settings)  # fmt: skip
            print(f"   {pools} {backend} ...", flush=True)
            profile = None
            if args.profile is not None:
                args.profile.mkdir(parents=True, exist_ok=True)
                profile = args.profile / f"{workdir.name}-{pools}-{backend}.prof"
            row = run_backend(spec, requests, tokens_per_block=args.tokens_per_block,
                              workdir=workdir / f"{pools}-{backend}", profile=profile,
                              switch_interval=args.switch_interval, io_options=parse_io_options(args))  # fmt: skip
            add_fractions(row, peaks)
            rows.append(row)
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows of one workload as a Markdown table."""
    head = ("| pools | backend | device / host / computed tokens | H2D / D2H MB | tree-cache ms/request (CPU) | "
            "exposed load / backup | mismatched bytes (checked) | tree core |")  # fmt: skip
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        if "prompt_tokens" not in r:
            lines.append(f"| {r['pools']} | {r['backend']} | not run ({r.get('phase')}): {r.get('error', '')} "
                         f"({r.get('at', '')}) |" + " |" * 5)  # fmt: skip
            continue

        def frac(key: str) -> str:
            v = r.get(key)
            return "-" if v is None else f"{v:.3f}"

        lines.append(
            f"| {r['pools']} | {r['backend']} | {r['device_hit_tokens']:,} / {r['host_hit_tokens']:,} / "
            f"{r['computed_tokens']:,} | {r['bytes_h2d'] / 1e6:.0f} / {r['bytes_d2h'] / 1e6:.0f} | "
            f"{r['tree_cache_ms_per_request']:.3f} ({frac('tree_cache_cpu_ms_per_request')}) | "
            f"{frac('exposed_load_fraction')} / {frac('exposed_backup_fraction')} | "
            f"{r['mismatched_bytes']:,} ({r['checked_bytes']:,}) | {r['tree_core'] or '-'} |"
        )
    return "\n".join(lines)


def breakdown_table(rows: Sequence[dict[str, Any]], top: int = 12) -> str:
    """Each row's outermost calls and `--breakdown`'s inner calls, the costliest first, in ms a request."""
    lines = ["| backend | call | calls | ms/request (CPU) | p50 us |", "|---|---|---|---|---|"]
    for r in rows:
        n = max(1, r.get("requests", 0))
        for kind in ("calls", "inner_calls"):
            ranked = sorted(r.get(kind, {}).items(), key=lambda kv: -kv[1]["total_ms"])[:top]
            for name, c in ranked:
                lines.append(f"| {r['backend']} | {'  ' * (kind == 'inner_calls')}{name} | {c['calls']:,} | "
                             f"{c['total_ms'] / n:.3f} ({c['cpu_ms'] / n:.3f}) | {c['p50_us']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def parse_io_options(args: argparse.Namespace) -> dict[str, int]:
    """`--io-option KEY=INT` flags as a dict (InputError naming the flag when one is malformed)."""
    out: dict[str, int] = {}
    for item in args.io_option:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier() or not value.lstrip("-").isdigit():
            raise InputError(f"--io-option {item!r}: expected KEY=INT, e.g. hook_worker_above=1000000")
        out[key] = int(value)
    return out


def parse_settings(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """`--setting FIELD=VALUE` flags as (field, value) pairs, each put through hicache-cp's
    own `HICACHE_<FIELD>` parsing (`Config.resolve`, unknown names refused): InputError
    naming the flag when one is malformed or its field or value is not one the cache takes."""
    out = []
    for item in args.setting:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"--setting {item!r}: expected FIELD=VALUE with a field of hicache-cp's Config")
        try:
            Config.resolve(env={f"HICACHE_{key.upper()}": value, STRICT_ENV: "1"})
        except ConfigError as exc:
            message = f"--setting {item!r}: expected FIELD=VALUE that hicache-cp's Config takes ({exc})"
            raise InputError(message) from None
        out.append((key, value))
    return tuple(out)


def check_arguments(args: argparse.Namespace) -> str:
    """Every flag checked before any work (exit code 2 naming the flag); the device to use."""
    parse_io_options(args)
    parse_settings(args)
    if args.switch_interval is not None and not 0 < args.switch_interval <= 1:
        raise InputError(f"--switch-interval {args.switch_interval}: must be in (0, 1] seconds")
    for flag in ("limit", "tokens_per_block", "device_pages", "layers", "host_ratio", "matmuls", "dim"):
        checks.positive("--" + flag.replace("_", "-"), getattr(args, flag), limit=1e6)
    checks.input_file("--trace", args.trace)
    checks.output_file("--json", args.json)
    if args.profile is not None:
        checks.output_file("--profile", args.profile / "race.prof")  # a folder files can be made in
    device = checks.device("--device", args.device)
    if device.startswith("cuda:"):
        raise InputError(f"--device {device}: the race runs on the current GPU (cuda or auto)")
    return device


def run(args: argparse.Namespace) -> int:
    if args.tables is not None:
        checks.input_file("--tables", args.tables)
        for name, rows in json.loads(args.tables.read_text())["workloads"].items():
            print(f"{name}:\n\n{table(rows)}\n")
        return 0
    device = check_arguments(args)
    workloads: dict[str, Sequence[TraceRequest]] = {}
    if "trace" in args.workloads:
        trace = args.trace or next((t for t in TRACES if t.exists()), None)
        if trace is not None and trace.exists():
            workloads["trace"] = load_trace(trace, limit=args.limit)
        else:
            print(f"note: no trace found ({args.trace or ', '.join(map(str, TRACES))}); that workload is skipped",
                  file=sys.stderr)
    if "embedded" in args.workloads:
        workloads["embedded"] = default_workload()[: args.limit]
    peaks = link_peaks() if device == "cuda" else None
    out: dict[str, Any] = {"commit": git_commit(), "machine": machine(), "command": command_line("bench-sglang"),
                           "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                           "sglang": "0.5.23", "link_peaks": peaks, "workloads": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        for name, reqs in workloads.items():
            print(f"-- {name}: {len(reqs)} requests", flush=True)
            rows = race(reqs, args, device, peaks, Path(tmp) / name)
            out["workloads"][name] = rows
            print(table(rows), flush=True)
            if args.breakdown:
                print(breakdown_table(rows), flush=True)
            if args.json:
                write_json(args.json, out)  # after every workload: a run cut short keeps what it measured
    if args.json:
        print(f"wrote {args.json}")
    bad = sum(r.get("mismatched_bytes", 0) for rows in out["workloads"].values() for r in rows)
    return 1 if bad else 0
