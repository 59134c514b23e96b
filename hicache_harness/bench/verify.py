"""`hicache-cp bench-verify`: what the restore checks (`hicache_cp.checksum`) cost.

CPU (always):

* `replay` in this process with `verify_restores` off, all and sample, in
  `--rounds` interleaved rounds (off, all, sample, off, ...), on the trace and
  model given (default: the embedded workload, tiny model); the ratio of each
  mode's median wall time to off's (target: all <= 1.10). The byte oracle runs
  in every mode (`--no-verify` turns it off in all of them). The checks hash
  with the compiled passes where they are built (`checksum.NATIVE`; the JSON's
  `hashes`); `--numpy-hashes` adds a fourth interleaved mode, `all_numpy`:
  checks on, hashed with numpy;
* the checksum's throughput over `--pages` pages of `--page-bytes`, numpy and
  compiled.

GPU (when CUDA is there, the checks as `hicache_cp.io.checked` runs them):

* the kernel's throughput over `--pages` pages x `--layers` layers against a
  contiguous pinned H2D copy (the PCIe link): target >= 20x;
* a compute-bound forward (bf16 matmuls, about `--forward-ms`) alone and beside
  the checks of a load of those pages on the checks' stream, `--pairs` times
  each, interleaved: the median of the pairs' ratios of the forward's own GPU
  time with them over without (target: <= 1.01);
* both again with the kernel's launches at one program a page and at 8, 2 and 1
  programs per SM (`checksum_gpu.PROGRAMS_PER_SM`; the library's row comes first).

Output: a table, and JSON with the provenance (commit, machine, command).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from hicache_cp import checksum
from hicache_harness.outputs import write_json
from hicache_harness.provenance import command_line, git_commit, machine
from hicache_cp.layout import Part

TARGETS = {"replay_all_over_off": 1.10, "kernel_over_pcie": 20.0, "forward_with_checks_over_alone": 1.01}
MODES = ("off", "all", "sample")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace (default: the embedded workload)")
    p.add_argument("--model", default="tiny", help="model preset of the replays (default tiny)")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--l2-fraction", type=float, help="L2 as a fraction of the footprint (the replay's default)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the three modes (default 5)")
    p.add_argument("--no-verify", action="store_true", help="turn the harness's byte oracle off in every mode")
    p.add_argument("--pages", type=int, default=1024, help="pages of the throughput measurements (default 1024)")
    p.add_argument("--page-bytes", type=int, default=41984, help="bytes a page a layer (default 64 tokens x 656 B)")
    p.add_argument("--layers", type=int, default=61, help="layers of the GPU measurements (default 61)")
    p.add_argument("--forward-ms", type=float, default=40.0, help="GPU time of the forward beside the checks")
    p.add_argument("--pairs", type=int, default=15, help="interleaved runs of the forward alone and beside (default 15)")
    p.add_argument("--skip-replay", action="store_true", help="only the throughput and GPU measurements")
    p.add_argument("--numpy-hashes", action="store_true",
                   help="also replay with the checks hashed by numpy (mode all_numpy), interleaved")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the results here")


def replay_walls(args: argparse.Namespace) -> dict[str, Any]:
    """Median wall time of the replay in each mode over interleaved rounds."""
    from hicache_harness.replay import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    modes = (*MODES, "all_numpy") if args.numpy_hashes else MODES
    walls: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    facts: dict[str, Any] = {}
    for _ in range(args.rounds):
        for mode in modes:
            verify = mode.removesuffix("_numpy")
            argv = ["--model", args.model, "--set", f"verify_restores={verify}", "--device", "cpu"]
            argv += ["--trace", str(args.trace)] if args.trace else []
            argv += ["--limit", str(args.limit)] if args.limit else []
            argv += ["--l2-fraction", str(args.l2_fraction)] if args.l2_fraction else []
            argv += ["--no-verify"] if args.no_verify else []
            with checksum.numpy_hashes() if mode.endswith("_numpy") else contextlib.nullcontext():
                t0, c0 = time.perf_counter(), time.process_time()
                report = command.replay(parser.parse_args(argv))
                walls[mode].append(time.perf_counter() - t0)
                cpus[mode].append(time.process_time() - c0)
            facts[mode] = {k: report.get(k) for k in ("hit_rate", "verified_pages", "verify_failures",
                                                       "integrity_checked_pages", "integrity_mismatches")}  # fmt: skip
    med = {m: statistics.median(w) for m, w in walls.items()}
    cpu = {m: statistics.median(w) for m, w in cpus.items()}
    return {
        # The process's CPU time (every thread): what the checks cost, less sensitive than the
        # wall time to the other work of a shared machine.
        "replay_cpu_s": {m: [round(x, 4) for x in w] for m, w in cpus.items()},
        "replay_cpu_s_median": {m: round(v, 4) for m, v in cpu.items()},
        "replay_cpu_all_over_off": round(cpu["all"] / cpu["off"], 4),
        "replay_cpu_sample_over_off": round(cpu["sample"] / cpu["off"], 4),
        "replay_wall_s": {m: [round(x, 4) for x in w] for m, w in walls.items()},
        "replay_wall_s_median": {m: round(v, 4) for m, v in med.items()},
        "replay_all_over_off": round(med["all"] / med["off"], 4),
        "replay_sample_over_off": round(med["sample"] / med["off"], 4),
        **({"replay_all_numpy_over_off": round(med["all_numpy"] / med["off"], 4),
            "replay_cpu_all_numpy_over_off": round(cpu["all_numpy"] / cpu["off"], 4)} if args.numpy_hashes else {}),
        "replay_facts": facts,
    }


def throughput(pages: int, page_bytes: int, numpy_only: bool = False) -> float:
    """GB/s of `checksum.checksums` on this core (median of 5), hashed as built, or by
    numpy (`checksum.numpy_hashes`)."""
    data = np.random.default_rng(0).integers(0, 256, (pages, page_bytes), dtype=np.uint8)
    with checksum.numpy_hashes() if numpy_only else contextlib.nullcontext():
        checksum.checksums(data[:4], Part.TARGET_KV, 0)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            checksum.checksums(data, Part.TARGET_KV, 0)
            times.append(time.perf_counter() - t0)
    return data.nbytes / statistics.median(times) / 1e9


def gpu_costs(pages: int, page_bytes: int, layers: int, forward_ms: float, pairs: int) -> dict[str, Any]:
    """The kernel's throughput against the PCIe link, and a forward beside the checks, for
    the library's launches and for others of one program a page or a few per SM
    (`checksum_gpu.PROGRAMS_PER_SM`): `pairs` runs of the forward alone and beside the
    checks, interleaved, and the median of each pair's ratio (the machine drifts by more
    than the checks cost from one block of runs to the next)."""
    import torch

    from hicache_harness.bench.io import _Gate, _median_ms, measure_peak
    from hicache_cp.io import checksum_gpu
    from hicache_cp.layout import KVLayout

    gate = _Gate()
    peak = measure_peak(gate, 1 << 30)
    layout = KVLayout.build(page_size=1, num_layers=layers, kv_bytes_per_token=page_bytes)
    buf = torch.randint(0, 256, (layers, pages + 1, page_bytes), dtype=torch.uint8, device="cuda")
    idx = torch.randperm(pages, device="cuda") + 1
    out = torch.empty((layers, pages + 1), dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = list(dict.fromkeys([checksum_gpu.PROGRAMS_PER_SM, None, 8, 2, 1]))  # the library's first, once

    def tables(n: int | None) -> Any:
        cap = None if n is None else n * sms
        return checksum_gpu.DeviceTables(layout, lambda part, slot: buf[slot].data_ptr(), buf.device, cap)

    def launch(t: Any) -> None:  # one load's checks: every page of every layer, on their own stream
        stream.wait_stream(torch.cuda.current_stream())
        checksum_gpu.launch(t, Part.TARGET_KV, 0, layers, idx, out.data_ptr(), pages + 1, idx, stream)

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    mm_ms, _ = _median_ms(gate, lambda: [torch.matmul(a, a, out=c) for _ in range(10)])
    n_mm = max(1, round(forward_ms / (mm_ms / 10)))

    def forward(t: Any | None) -> None:
        if t is not None:
            launch(t)
        for _ in range(n_mm):
            torch.matmul(a, a, out=c)
        gate.mark_launched()
        if t is not None:
            torch.cuda.current_stream().wait_stream(stream)

    def checks(t: Any) -> None:
        launch(t)
        torch.cuda.current_stream().wait_stream(stream)

    def paired(t: Any) -> tuple[list[float], list[float]]:
        """The forward's own GPU ms alone and beside `t`'s checks, run after run."""
        forward(None)  # warm-up
        forward(t)
        alone, beside = [], []
        for _ in range(pairs):
            gate.time_ms(lambda: forward(None))
            alone.append(gate.compute_ms)
            gate.time_ms(lambda: forward(t))
            beside.append(gate.compute_ms)
        return alone, beside

    nbytes = layers * pages * page_bytes
    rows = []
    for n in per_sm:
        t = tables(n)
        checks_ms, _ = _median_ms(gate, lambda: checks(t))
        alone, beside = paired(t)
        ratios = sorted(b / a for a, b in zip(alone, beside))
        gbps = nbytes / (checks_ms * 1e-3) / 1e9
        rows.append({"programs_per_sm": n, "kernel_ms": checks_ms, "kernel_gbps": gbps,
                     "kernel_over_pcie": gbps / peak["peak_h2d_gbps"], "forward_pairs": pairs,
                     "forward_alone_ms": statistics.median(alone), "forward_with_checks_ms": statistics.median(beside),
                     "forward_with_checks_over_alone": statistics.median(ratios),
                     "forward_ratio_quartiles": [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]})  # fmt: skip
    default = rows[0]
    return {
        "device": torch.cuda.get_device_name(), "sms": sms, **peak, **default, "kernel_bytes": nbytes,
        "checks_bytes_beside_forward": nbytes, "by_programs_per_sm": rows,
    }


def run(args: argparse.Namespace) -> int:
    if args.pairs < 1:
        print(f"bench-verify: --pairs must be >= 1, got {args.pairs}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"commit": git_commit(), "machine": machine(), "command": command_line("bench-verify")}
    if not args.skip_replay:
        result.update(replay_walls(args))
    result["hashes"] = "compiled" if checksum.NATIVE else "numpy"
    result["numpy_gbps"] = round(throughput(min(args.pages, 256), args.page_bytes, numpy_only=True), 3)
    if checksum.NATIVE:
        result["compiled_gbps"] = round(throughput(min(args.pages, 256), args.page_bytes), 3)
    import torch

    if torch.cuda.is_available():
        result["gpu"] = gpu_costs(args.pages, args.page_bytes, args.layers, args.forward_ms, args.pairs)
    result["targets"] = TARGETS
    _print_table(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _print_table(r: dict[str, Any]) -> None:
    print(f"bench-verify at {r.get('commit')} on {r.get('machine')}")
    if "replay_wall_s_median" in r:
        med = r["replay_wall_s_median"]
        print(f"  replay wall (median of {len(r['replay_wall_s']['off'])}): " +
              ", ".join(f"{m} {med[m]:.3f} s" for m in MODES))  # fmt: skip
        print(f"  all / off {r['replay_all_over_off']:.3f} (target <= {TARGETS['replay_all_over_off']}), "
              f"sample / off {r['replay_sample_over_off']:.3f}")
        print(f"  process CPU time: all / off {r['replay_cpu_all_over_off']:.3f}, "
              f"sample / off {r['replay_cpu_sample_over_off']:.3f}")
        if "replay_all_numpy_over_off" in r:
            print(f"  checks hashed by numpy: all / off {r['replay_all_numpy_over_off']:.3f}, "
                  f"process CPU {r['replay_cpu_all_numpy_over_off']:.3f}")
    compiled = f", compiled {r['compiled_gbps']:.2f} GB/s" if "compiled_gbps" in r else " (compiled hashes not built)"
    print(f"  checksum on one core: numpy {r['numpy_gbps']:.2f} GB/s{compiled}; the checks hashed {r['hashes']}")
    g = r.get("gpu")
    if g:
        print(f"  GPU {g['device']}: kernel {g['kernel_gbps']:.0f} GB/s = {g['kernel_over_pcie']:.1f}x the H2D link "
              f"({g['peak_h2d_gbps']:.1f} GB/s; target >= {TARGETS['kernel_over_pcie']:.0f}x)")
        q = g.get("forward_ratio_quartiles")
        spread = f", quartiles {q[0]:.4f}-{q[1]:.4f} of {g['forward_pairs']} pairs" if q else ""
        print(f"  forward {g['forward_alone_ms']:.2f} ms alone, {g['forward_with_checks_ms']:.2f} ms beside a load's "
              f"checks: {g['forward_with_checks_over_alone']:.4f}x{spread} "
              f"(target <= {TARGETS['forward_with_checks_over_alone']})")
        print(f"  by launch size ({g['sms']} SMs): programs per SM | kernel GB/s | x PCIe | forward beside checks / alone")
        for row in g["by_programs_per_sm"]:
            cap = "a page each" if row["programs_per_sm"] is None else row["programs_per_sm"]
            print(f"    {cap!s:>12} | {row['kernel_gbps']:8.0f} | {row['kernel_over_pcie']:5.1f} | "
                  f"{row['forward_with_checks_over_alone']:.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicache-cp bench-verify", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
