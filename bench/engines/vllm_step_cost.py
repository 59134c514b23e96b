"""The vLLM connector's host time per engine step, on CPU, in the GPU race's workload shape.

    PYTHONPATH=$PWD .venv/bin/python bench/engines/vllm_step_cost.py [--json OUT.json] [--profile N]
        [--docs 12 --doc-len 2048 --suffix-len 48 --gen 16 --layers 16 --gpu-blocks 768]

vLLM 0.33's real `Scheduler` and the connector's real worker side (CPU copy
engine), driven by the bench's fake model runner (tests/test_vllm_bench.py,
dense GQA layers in vLLM's own allocation, layout LBHNC) through the race's
workload (bench/engines/vllm_race.py): `--docs` documents asked one at a time
(pass 1: computed and saved; pass 2: vLLM's GPU prefix cache has evicted them,
the host tier serves them), then every document at once with `--gen` decode
steps (the batch). Each of the connector's methods is timed as vLLM calls it
(`vllm_race.StepTimer`); the times are the connector's host work and its CPU
copies (which a GPU runs asynchronously), so compare per method, and the
step counts, across commits on the same machine.

`--profile N`: run the workload under cProfile, restricted to the connector's
calls, and print the N costliest functions (cumulative). `--no-checks` skips
the fake runner's byte checks (they cost more than the connector; the counts
of mismatches are then not reported).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench" / "engines"))

import test_vllm_bench as H  # noqa: E402  (vLLM's Scheduler + the fake model runner)

from hicache_harness.outputs import write_json  # noqa: E402
from hicache_harness.provenance import git_commit, machine  # noqa: E402
from vllm_race import StepTimer, add_workload_args, prompts  # noqa: E402


class _Profiled(StepTimer):
    """`StepTimer` that also profiles (cProfile) inside the connector's calls only, one
    profile per method: its Python function calls count the work it does, whatever the
    machine's speed and the copy threads' share of the GIL."""

    def __init__(self, profile: bool) -> None:
        super().__init__(explicit=True)
        self.profiles: dict[str, cProfile.Profile] | None = {} if profile else None
        self.samples: dict[str, list[float]] = {}  # method -> seconds of each call
        self._depth = 0

    def _timed(self, real, role: str, closes: bool):
        inner = super()._timed(real, role, closes)
        samples = self.samples.setdefault(real.__name__, [])

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                samples.append(time.perf_counter() - t)

        if self.profiles is None:
            return timed
        prof = self.profiles.setdefault(real.__name__, cProfile.Profile())

        def profiled(*a, **kw):
            self._depth += 1
            if self._depth == 1:
                prof.enable()
            try:
                return timed(*a, **kw)
            finally:
                if self._depth == 1:
                    prof.disable()
                self._depth -= 1

        return profiled

    def python_calls(self) -> dict[str, int]:
        """Python function calls made inside each method, all calls of it together."""
        return {name: pstats.Stats(p).total_calls for name, p in sorted((self.profiles or {}).items()) if p.getstats()}


def run(args: argparse.Namespace, model_dir: Path, timer: _Profiled) -> dict:
    vocab = H.TINY_DEEPSEEK["vocab_size"]
    ps = prompts(args.docs, args.doc_len, args.suffix_len, vocab)
    page_bytes = H.layer_specs("llama", args.layers)[0].page_bytes * args.layers
    b = H.make_bench(model_dir, shape="llama", layout="LBHNC", num_blocks=args.gpu_blocks,
                     host_pages=args.host_bytes // page_bytes, max_batched=args.max_batched,
                     max_model_len=args.doc_len + args.suffix_len + args.gen + 64, debug_checks=False)
    b.sched.max_num_running_reqs = 32
    if args.no_checks:
        b._check = lambda *a, **kw: None  # the fake runner's byte checks off (profiling the connector)
    for role in (b.sched.connector, *b.workers):
        timer.wrap(role)
    steps = {"pass1": 0, "pass2": 0, "batch": 0}
    loaded = 0
    t0 = time.perf_counter()
    try:
        def drain(phase: str) -> None:
            nonlocal loaded
            for _ in range(10_000):
                if not b.sched.requests:
                    return
                rec = b.step()
                timer.end_step()
                steps[phase] += 1
                loaded += sum(p for _, _, p in rec.loads) * H.BLOCK
            raise AssertionError(f"{phase}: requests unfinished: {list(b.sched.requests)}")

        for phase in ("pass1", "pass2"):
            for p in ps[phase]:
                b.add(p)
                drain(phase)
        for p in ps["batch"]:
            b.add(p, max_tokens=args.gen)
        drain("batch")
    finally:
        b.close()
    summary = timer.summary()
    for name, xs in timer.samples.items():  # the median call: robust to a GIL wait on the copy threads
        if xs and name in summary["by_method"]:
            summary["by_method"][name]["p50_us"] = round(1e6 * sorted(xs)[len(xs) // 2], 1)
    if timer.profiles is not None:
        for name, calls in timer.python_calls().items():
            summary["by_method"][name]["python_calls"] = calls
    return {"steps": steps, "host_tokens": loaded, "wall_s": round(time.perf_counter() - t0, 2),
            "mismatches": None if args.no_checks else len(b.mismatches), **summary}


def table(r: dict) -> str:
    lines = [f"steps {r['steps']}, host tokens loaded {r['host_tokens']}, mismatches {r['mismatches']}",
             "| role | steps | mean ms | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for role in ("scheduler", "worker"):
        s = r[role]
        lines.append(f"| {role} | {s['steps']} | {s['mean_ms']} | {s['p50_ms']} | {s['p99_ms']} |")
    lines += ["| method | calls | total ms | mean us/call | p50 us/call | Python calls |", "|---|---|---|---|---|---|"]
    for name, m in r["by_method"].items():
        us = 1000 * m["total_ms"] / max(1, m["calls"])
        lines.append(f"| {name} | {m['calls']} | {m['total_ms']} | {us:.1f} | {m.get('p50_us', '-')} "
                     f"| {m.get('python_calls', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile; print the N costliest")
    ap.add_argument("--sort", default="cumulative", help="the profile's order (pstats keys: cumulative, tottime)")
    ap.add_argument("--no-checks", action="store_true", help="skip the fake runner's byte checks")
    add_workload_args(ap)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--max-batched", type=int, default=8192)
    ap.add_argument("--host-bytes", type=int, default=256 << 20)
    args = ap.parse_args(argv)
    timer = _Profiled(bool(args.profile))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = H.write_model_dir(Path(tmp) / "tiny", args.layers)
        result = run(args, model_dir, timer)
    print(table(result))
    if timer.profiles:
        out = io.StringIO()
        stats = pstats.Stats(*(p for p in timer.profiles.values() if p.getstats()), stream=out)
        stats.sort_stats(args.sort).print_stats(args.profile)
        print(out.getvalue())
    if args.json:
        import vllm

        write_json(args.json, {
            "commit": git_commit(), "machine": machine(), "vllm": vllm.__version__,
            "command": " ".join(["bench/engines/vllm_step_cost.py", *(argv if argv is not None else sys.argv[1:])]),
            "params": {k: v for k, v in vars(args).items() if k != "json"}, "result": result,
        })
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
