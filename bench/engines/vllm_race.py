"""Issue 43: vLLM 0.33's own GPU model runner with hicache-cp's connector, raced against
vLLM's OffloadingConnector and against no connector, on one GPU, at the same host bytes.

    python3 bench/engines/vllm_race.py --json OUT.json [--configs hicache,offloading,none] [--eager] [--quick]

Each configuration runs in its own process (`--one NAME`): `vllm.LLM` offline on a random-
weight Llama written from a config (`load_format="dummy"`, token-id prompts, no tokenizer),
vLLM's V2 model runner with the Triton attention backend, native custom ops, the KV cache
layout LBHNC for all three (the OffloadingConnector's; page-major for ours), GPU KV capped at
`--gpu-blocks` blocks so vLLM's own prefix cache evicts, and CUDA graphs (vLLM's default
FULL_AND_PIECEWISE, breakable piecewise graphs instead of torch.compile) unless `--eager`.

An untimed run of `none` comes first (`--no-prime` skips it): the kernels and graphs every
configuration builds then come from the on-disk caches for all of them alike.

Workload (the same token ids for every configuration, greedy):
  warm-up a document of its own and a short prompt, 2 tokens each, not counted (vLLM's
          kernels compile in whichever configuration runs first; `--no-warmup` skips it)
  ttft    `--docs` documents of `--doc-len` tokens, each asked once (pass 1: computed) and
          then again with another suffix (pass 2: the GPU has evicted it; a host tier serves
          it). One request at a time, max_tokens=1: wall time per request is its TTFT.
  batch   every document with a third suffix, all at once, `--gen` tokens each: throughput.
Reported per configuration: TTFT p50/p90 of pass 2 (and pass 1), prompt tokens by source
from vLLM's own counters (GPU prefix cache, external = host, computed), batch tokens/s,
host time per engine step spent in the connector's scheduler-side and worker-side methods
(wrapped with a timer in this process), over the run and over the batch pass alone
(`connector_host_time_batch`), and every output's token ids, compared across the
configurations (greedy identity). Writes JSON with commit, machine and command, and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5504,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 32000, "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
QUICK = {**LLAMA, "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 64}

SCHED_METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "update_connector_output", "request_finished", "request_finished_all_groups")
WORKER_METHODS = ("handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                  "get_finished", "get_block_ids_with_load_errors", "build_connector_worker_meta")


class StepTimer:
    """Host seconds spent in a connector's methods, per engine step and role: wall time, and
    the calling thread's CPU time (wall minus CPU: time it waited, for copies or for the GIL).
    The step of a role ends at its last call of the step (`build_connector_meta`,
    `build_connector_worker_meta`), or, with `explicit`, at `end_step()` (a driver that
    knows where its steps end)."""

    def __init__(self, explicit: bool = False) -> None:
        self.steps: dict[str, list[float]] = {"scheduler": [], "worker": []}
        self._open = {"scheduler": 0.0, "worker": 0.0}
        self.cpu = {"scheduler": 0.0, "worker": 0.0}  # thread CPU seconds, all steps
        self.methods: dict[str, list[float]] = {}  # method -> [calls, seconds, CPU seconds]
        self.explicit = explicit
        self.workers: dict[int, object] = {}  # the connectors whose worker-side methods ran, by id

    def wrap(self, target: object) -> None:
        """Time `target`'s connector methods: a class (every instance, both roles) or one instance."""
        if not isinstance(target, type):
            self.workers[id(target)] = target
        for role, names, last in (("scheduler", SCHED_METHODS, "build_connector_meta"),
                                  ("worker", WORKER_METHODS, "build_connector_worker_meta")):
            for name in names:
                real = (target.__dict__.get(name) if isinstance(target, type) else None) or getattr(target, name, None)
                if real is None:
                    continue
                setattr(target, name, self._timed(real, role, name == last and not self.explicit))

    def end_step(self) -> None:
        """Close the step of both roles (`explicit` timers)."""
        for role in self.steps:
            self.steps[role].append(self._open[role])
            self._open[role] = 0.0

    def _timed(self, real, role: str, closes: bool):
        def timed(*a, **kw):
            if role == "worker" and a and id(a[0]) not in self.workers and hasattr(a[0], real.__name__):
                self.workers[id(a[0])] = a[0]
            t, c = time.perf_counter(), time.thread_time()
            try:
                return real(*a, **kw)
            finally:
                dt, dc = time.perf_counter() - t, time.thread_time() - c
                self.cpu[role] += dc
                self._open[role] += dt
                m = self.methods.setdefault(real.__name__, [0, 0.0, 0.0])
                m[0] += 1
                m[1] += dt
                m[2] += dc
                if closes:
                    self.steps[role].append(self._open[role])
                    self._open[role] = 0.0
        return timed

    def mark(self) -> dict:
        """What `summary(since=...)` leaves out: the steps closed and the calls made so far."""
        return {"steps": {role: len(xs) for role, xs in self.steps.items()}, "cpu": dict(self.cpu),
                "methods": {name: list(m) for name, m in self.methods.items()}}

    def summary(self, since: dict | None = None) -> dict:
        """Per role: steps, wall ms per step (mean, p50, p99, total), thread CPU per step;
        per method: calls, wall and CPU ms. `since` (a `mark()`): only what came after it
        (a workload's phase)."""
        since = since or {"steps": {}, "cpu": {}, "methods": {}}
        out = {}
        for role, all_steps in self.steps.items():
            xs = sorted(all_steps[since["steps"].get(role, 0):])
            cpu = self.cpu[role] - since["cpu"].get(role, 0.0)
            out[role] = {"steps": len(xs), "mean_ms": _ms(sum(xs) / len(xs)) if xs else None,
                         "p50_ms": _ms(_pct(xs, 50)), "p99_ms": _ms(_pct(xs, 99)), "total_ms": _ms(sum(xs)),
                         "cpu_mean_ms": _ms(cpu / len(xs)) if xs else None}
        before = since["methods"]
        methods = {name: [v - b for v, b in zip(m, before.get(name, (0, 0.0, 0.0)))] for name, m in self.methods.items()}
        out["by_method"] = {name: {"calls": n, "total_ms": _ms(t), "cpu_ms": _ms(c)}
                            for name, (n, t, c) in sorted(methods.items()) if n}
        return out


def restore_checks(connectors: list[object]) -> dict | None:
    """The restore checks of hicache-cp's connectors (their worker side's engine): units
    (page, part, layer) compared per tier, and those that differed per tier and part;
    None when no connector has an engine (another connector, or none started)."""
    checked: dict[str, int] = {}
    failed: dict[str, int] = {}
    found = False
    for c in connectors:
        engine = getattr(getattr(c, "worker_side", None), "engine", None)
        if engine is None:
            continue
        found = True
        ok, bad = engine.integrity.snapshot()
        for tier, n in ok.items():
            checked[tier] = checked.get(tier, 0) + n
        for (tier, part), n in bad.items():
            failed[f"{tier}/{part}"] = failed.get(f"{tier}/{part}", 0) + n
    return {"checked_units": checked, "failed_units": failed} if found else None


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


def prompts(docs: int, doc_len: int, suffix_len: int, vocab: int) -> dict[str, list[list[int]]]:
    """Deterministic token ids: `docs` shared prefixes, three suffixes each (pass 1, pass 2,
    batch), and the warm-up's prompts."""
    import numpy as np

    rng = np.random.default_rng(43)
    bodies = [rng.integers(10, vocab - 10, doc_len).tolist() for _ in range(docs)]
    out = {}
    for name in ("pass1", "pass2", "batch"):
        out[name] = [b + rng.integers(10, vocab - 10, suffix_len).tolist() for b in bodies]
    # a document of its own and a short prompt, before anything is timed (shares no block with the rest)
    out["warmup"] = [rng.integers(10, vocab - 10, doc_len + suffix_len).tolist(), rng.integers(10, vocab - 10, 40).tolist()]
    return out


def kv_transfer(name: str, host_bytes: int, extra: dict | None = None) -> dict | None:
    """The kv_transfer_config of a configuration; `extra`: more of our connector's settings."""
    if name == "hicache":
        return {"kv_connector": "HiCacheConnector", "kv_connector_module_path": "hicache_cp.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"host_budget_bytes": host_bytes, **(extra or {})}}
    if name == "offloading":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"cpu_bytes_to_use": host_bytes}}
    if name == "none":
        return None
    raise ValueError(f"unknown configuration {name!r}")


def run_one(args: argparse.Namespace) -> dict:
    """One configuration in this process (`--one`)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core and worker here: one timer
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_KV_CACHE_LAYOUT", "LBHNC")
    if not args.eager:
        os.environ.setdefault("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    report: dict = {"config": args.one, "stage": "import", "ok": False, "eager": args.eager}
    t0 = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        timer = StepTimer()
        if args.one == "hicache":
            from hicache_cp.integrations.vllm import HiCacheConnector
            timer.wrap(HiCacheConnector)
        elif args.one == "offloading":
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
            timer.wrap(OffloadingConnector)
        report["stage"] = "build"
        model = Path(tempfile.mkdtemp()) / "llama"
        model.mkdir()
        cfg = QUICK if args.quick else LLAMA
        (model / "config.json").write_text(json.dumps(cfg))
        compilation = {"custom_ops": ["none"], "mode": 0}
        if not args.eager:
            compilation.update(cudagraph_mode="FULL_AND_PIECEWISE", cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32])
        kw = dict(model=str(model), skip_tokenizer_init=True, load_format="dummy", enforce_eager=args.eager,
                  dtype="bfloat16", max_model_len=args.doc_len + args.suffix_len + args.gen + 64,
                  gpu_memory_utilization=0.5, enable_prefix_caching=True, block_size=16, seed=0,
                  num_gpu_blocks_override=args.gpu_blocks, max_num_seqs=32, disable_log_stats=False,
                  attention_config={"backend": "TRITON_ATTN"}, compilation_config=compilation)
        transfer = kv_transfer(args.one, args.host_bytes, extra_settings(args))
        if transfer is not None:
            kw["kv_transfer_config"] = transfer
        t = time.perf_counter()
        with profiled(args.profile, f"{args.one} start-up"):
            llm = LLM(**kw)
        report["startup_s"] = round(time.perf_counter() - t, 1)
        cg = llm.llm_engine.vllm_config.compilation_config
        report["cudagraph_mode"] = str(cg.cudagraph_mode)
        report["kv_cache_layout"] = llm.llm_engine.vllm_config.cache_config.kv_cache_layout
        report["stage"] = "generate"
        ps = prompts(args.docs, args.doc_len, args.suffix_len, cfg["vocab_size"])
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, logprobs=0)
        before: dict = {}
        timed_from = None
        if not args.no_warmup:  # kernels compiled and caches filled outside what is timed, whatever runs first
            t = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps["warmup"]],
                         SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False), use_tqdm=False)
            report["warmup_s"] = round(time.perf_counter() - t, 2)
            before = prompt_token_counters(llm)
            timed_from = timer.mark()
        ttft: dict[str, list[float]] = {"pass1": [], "pass2": []}
        outputs: dict[str, list[list[int]]] = {"pass1": [], "pass2": [], "batch": []}
        logprobs: dict[str, list[float | None]] = {"pass1": [], "pass2": []}
        for name in ("pass1", "pass2"):
            for p in ps[name]:
                t = time.perf_counter()
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=p)], one, use_tqdm=False)
                ttft[name].append(time.perf_counter() - t)
                outputs[name].append(list(out.outputs[0].token_ids))
                logprobs[name].append(sampled_logprob(out.outputs[0]))
        report["logprobs"] = logprobs
        gen = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True, detokenize=False)
        batch_mark = timer.mark()
        t = time.perf_counter()
        with profiled(args.profile, f"{args.one} batch"):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps["batch"]], gen, use_tqdm=False)
        wall = time.perf_counter() - t
        outputs["batch"] = [list(o.outputs[0].token_ids) for o in outs]
        tokens = sum(len(p) for p in ps["batch"]) + sum(len(o) for o in outputs["batch"])
        report["batch"] = {"requests": len(outs), "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
                           "generated_per_s": round(sum(len(o) for o in outputs["batch"]) / wall, 1)}
        report["ttft_ms"] = {k: {"p50": _ms(_pct(v, 50)), "p90": _ms(_pct(v, 90)), "n": len(v)} for k, v in ttft.items()}
        report["prompt_tokens"] = counters_since(prompt_token_counters(llm), before)
        by_source = report["prompt_tokens"].get("prompt_tokens_by_source", {})
        report["host_tokens"] = by_source.get("external_kv_transfer", 0)
        report["connector_host_time_per_step"] = timer.summary(since=timed_from) if args.one != "none" else None
        report["connector_host_time_batch"] = timer.summary(since=batch_mark) if args.one != "none" else None
        report["restore_checks"] = restore_checks(list(timer.workers.values()))
        report["outputs"] = outputs
        report["ok"] = True
        report["stage"] = "done"
    except BaseException as exc:  # noqa: BLE001 - a run: record what stopped it
        report["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        report["traceback_tail"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


@contextlib.contextmanager
def profiled(on: bool, what: str, top: int = 30):
    """With `on`: cProfile the block (every thread, on Python 3.12) and print its top
    functions by own time and by cumulative time."""
    if not on:
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
            print(f"--- profile of {what}, by {key}\n{buf.getvalue()}", flush=True)


def extra_settings(args: argparse.Namespace) -> dict:
    """`--extra KEY=VALUE` flags (VALUE as JSON, else a string) for our connector's settings."""
    out = {}
    for item in args.extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--extra {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def sampled_logprob(completion) -> float | None:
    """The log-probability of the one sampled token (None where vLLM returned none): a
    sensitive check of the KV it attended to, compared across the configurations."""
    lps = getattr(completion, "logprobs", None)
    if not lps:
        return None
    entry = lps[0].get(completion.token_ids[0]) if hasattr(lps[0], "get") else None
    return None if entry is None else float(getattr(entry, "logprob", entry))


def prompt_token_counters(llm) -> dict:
    """vLLM's own prompt-token counters: by source (local_compute, local_cache_hit,
    external_kv_transfer) and cached by tier (device, host, ...)."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached_by_source"):
            source = dict(getattr(m, "labels", {}) or {}).get("source", "?")
            out.setdefault(m.name.split(":", 1)[1], {})[source] = int(getattr(m, "value", 0))
        elif m.name in ("vllm:prompt_tokens", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits"):
            out[m.name.split(":", 1)[1]] = int(getattr(m, "value", 0))
    return out


def counters_since(now: dict, before: dict) -> dict:
    """`prompt_token_counters` minus an earlier reading of them (the warm-up's)."""
    out: dict = {}
    for k, v in now.items():
        if isinstance(v, dict):
            out[k] = {s: n - before.get(k, {}).get(s, 0) for s, n in v.items()}
        else:
            out[k] = v - before.get(k, 0)
    return out


def compare(runs: dict[str, dict]) -> dict:
    """Greedy identity of every output against the no-connector run (else the first that ran)."""
    ok = {k: r for k, r in runs.items() if r.get("ok")}
    if not ok:
        return {}
    base_name = "none" if "none" in ok else next(iter(ok))
    base = ok[base_name]["outputs"]
    out = {"baseline": base_name}
    base_lp = ok[base_name].get("logprobs") or {}
    for name, r in ok.items():
        diff = [(phase, i) for phase in base for i, (a, b) in enumerate(zip(base[phase], r["outputs"][phase])) if a != b]
        out[name] = {"identical": not diff, "differing": diff[:10]}
        deltas = [abs(a - b) for phase in base_lp for a, b in zip(base_lp[phase], (r.get("logprobs") or {}).get(phase, []))
                  if a is not None and b is not None]
        if deltas:
            out[name]["max_abs_logprob_delta"] = max(deltas)
    return out


def table(runs: dict[str, dict], identity: dict | None = None) -> str:
    def row(label, f):
        return f"| {label} | " + " | ".join(f(runs[k]) if runs[k].get("ok") else "failed" for k in runs) + " |"

    def tok(r, *keys):
        d = r.get("prompt_tokens", {})
        for k in keys:
            d = d.get(k, {}) if isinstance(d, dict) else {}
        return str(d) if not isinstance(d, dict) else "-"

    def host(r, role):
        t = r.get("connector_host_time_per_step") or {}
        t = t.get(role) or {}
        return "-" if t.get("mean_ms") is None else f"{t['mean_ms']} / {t['p99_ms']}"

    def batch_host(r):
        t = r.get("connector_host_time_batch") or {}
        s, w = t.get("scheduler") or {}, t.get("worker") or {}
        if s.get("total_ms") is None or w.get("total_ms") is None:
            return "-"
        return f"{s['total_ms']:.1f} + {w['total_ms']:.1f} ({w['steps']})"

    def checks(r):
        c = r.get("restore_checks")
        return "-" if not c else f"{sum(c['checked_units'].values()):,} / {sum(c['failed_units'].values()):,}"

    lines = ["| vLLM 0.33.0, GPU | " + " | ".join(runs) + " |", "|---" * (len(runs) + 1) + "|",
             row("TTFT pass 2 (evicted from GPU) p50 / p90 ms", lambda r: f"{r['ttft_ms']['pass2']['p50']} / {r['ttft_ms']['pass2']['p90']}"),
             row("TTFT pass 1 (cold) p50 / p90 ms", lambda r: f"{r['ttft_ms']['pass1']['p50']} / {r['ttft_ms']['pass1']['p90']}"),
             row("prompt tokens: GPU prefix cache", lambda r: tok(r, "prompt_tokens_by_source", "local_cache_hit")),
             row("prompt tokens: from host (external)", lambda r: tok(r, "prompt_tokens_by_source", "external_kv_transfer")),
             row("prompt tokens: computed", lambda r: tok(r, "prompt_tokens_by_source", "local_compute")),
             row("batch tokens/s", lambda r: str(r["batch"]["tokens_per_s"])),
             row("scheduler-side host ms/step mean / p99", lambda r: host(r, "scheduler")),
             row("worker-side host ms/step mean / p99", lambda r: host(r, "worker")),
             row("batch pass: connector host ms, scheduler + worker (steps)", batch_host),
             row("restore checks: units checked / failed", checks),
             row("CUDA graphs", lambda r: r.get("cudagraph_mode", "-"))]
    identity = identity or {}
    same = {k: identity.get(k, {}) for k in runs}
    lines.append(f"| greedy outputs identical to {identity.get('baseline', '-')} | "
                 + " | ".join(str(same[k].get("identical", "-")) for k in runs) + " |")
    lines.append("| max abs logprob delta of the sampled token, passes 1-2 | "
                 + " | ".join(str(same[k].get("max_abs_logprob_delta", "-")) for k in runs) + " |")
    return "\n".join(lines)


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload's arguments (`prompts`, vLLM's GPU blocks); bench/engines/vllm_step_cost.py takes them too."""
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--suffix-len", type=int, default=48)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=768, help="vLLM's GPU KV blocks of 16 tokens")


def run_config(name: str, args: argparse.Namespace, passthrough: list[str]) -> dict:
    """One configuration in its own process (`--one`) and session, under `args.timeout`: its
    report, or a failed one saying why; with `leftover_processes`, how many of its processes
    outlived it and were killed before the next configuration (`hicache_harness.sessions`)."""
    from hicache_harness.sessions import run_in_session

    out = Path(tempfile.mkdtemp()) / f"{name}.json"
    cmd = [sys.executable, __file__, "--one", name, "--out", str(out), *passthrough]
    cmd += ["--eager"] if args.eager else []
    cmd += ["--quick"] if args.quick else []
    print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
    child = run_in_session(cmd, args.timeout, capture=False)
    if child.returncode is None:
        report = {"config": name, "ok": False, "error": f"timed out after {args.timeout} s"}
    elif out.exists():
        report = json.loads(out.read_text())
    else:
        report = {"config": name, "ok": False, "error": "no report written"}
    report["leftover_processes"] = child.leftover
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--configs", default="hicache,offloading,none")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--quick", action="store_true", help="a smaller model and workload (smoke)")
    add_workload_args(ap)
    ap.add_argument("--host-bytes", type=int, default=4 << 30, help="host bytes for either connector")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per configuration")
    ap.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                    help="one more of our connector's kv_connector_extra_config settings (repeatable)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of each start-up and batch")
    ap.add_argument("--no-warmup", action="store_true",
                    help="time from the first request (default: a warm-up of its own document first, not counted)")
    ap.add_argument("--no-prime", dest="prime", action="store_false",
                    help="skip the untimed priming run of `none` before the timed configurations (it fills "
                         "the on-disk kernel caches the first timed configuration would pay for alone)")
    args = ap.parse_args()
    if args.quick and not args.one:
        args.docs, args.doc_len, args.gpu_blocks, args.host_bytes = 6, 512, 160, 1 << 30
    if args.one:
        report = run_one(args)
        args.out.write_text(json.dumps(report) + "\n")
        print(json.dumps({k: v for k, v in report.items() if k not in ("outputs", "traceback_tail")}, indent=2))
        return 0 if report["ok"] else 1
    from hicache_harness.provenance import git_commit, machine

    runs: dict[str, dict] = {}
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                   if k in ("docs", "doc_len", "suffix_len", "gen", "gpu_blocks", "host_bytes")]
    passthrough += [f"--extra={e}" for e in args.extra] + (["--profile"] if args.profile else [])
    passthrough += ["--no-warmup"] if args.no_warmup else []
    result = {"commit": os.environ.get("HICACHE_COMMIT") or git_commit(), "machine": machine(),
              "command": " ".join(["python3", "bench/engines/vllm_race.py", *sys.argv[1:]]),
              "params": {k: v for k, v in vars(args).items() if k not in ("json", "one", "out")},
              "model": QUICK if args.quick else LLAMA, "runs": runs}
    if args.prime:  # untimed: the on-disk kernel and graph caches filled before any timed run
        print("=== none (priming, untimed)", flush=True)
        result["prime"] = {k: v for k, v in run_config("none", args, passthrough).items() if k in ("ok", "error")}
    for name in args.configs.split(","):
        runs[name] = run_config(name, args, passthrough)
        result["identity"] = compare(runs)
        result["table"] = table(runs, result["identity"])
        if args.json:  # after every configuration: a run cut short keeps what finished
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(result["table"])
    print(json.dumps(result["identity"], indent=2))
    return 0 if all(r.get("ok") for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
