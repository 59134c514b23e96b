#!/usr/bin/env python3
"""A real `sglang.Engine` three ways on one GPU: hicache-cp, SGLang's own HiCache, no host tier (issue 42, item 6).

    python3 bench/engines/sglang_engine.py --json $OUT/sglang-engine-h100.json [--model deepseek|llama] [--quick]

The engine serves a tiny random model built from a config (no download, no
tokenizer: prompts are token ids; `load_format=dummy` with a fixed seed, so
the three runs hold the same weights): a dense `DeepseekV3ForCausalLM` (MLA,
`first_k_dense_replace` = `num_hidden_layers`, no MoE, no DSA) or, with
`--model llama`, a `LlamaForCausalLM` (GQA; hicache-cp needs its MHA pools
for this one). Triton attention, PyTorch sampling, no CUDA graph, page 64,
SGLang's torch paths for fused ops (`SGLANG_FORCE_FUSED_OP_BACKEND=torch`).
Each mode runs in its own child process (a fresh engine, its own GPU memory,
a timeout), one after the other, after an untimed priming run of `none`
(`--no-prime` skips it: it builds the kernels every mode uses, whose on-disk
caches the first timed mode would otherwise pay for alone):

    hicache-cp       --radix-cache-backend hicache-cp, host budget = SGLang's host pool bytes
    sglang-hicache   --enable-hierarchical-cache, --hicache-ratio, io backend kernel, page_first
    none             SGLang's device radix tree only

After one untimed warm-up prompt (its own tokens), the same prompts in the
same order, one at a time: `groups` long shared prefixes, each asked
`rounds` times with a new suffix, round-robin; the device KV
(`max_total_tokens`) holds about two prompts, so SGLang's device tree
evicts and a prefix asked again comes from host memory or is computed.
Greedy decoding of `new_tokens` tokens.

Reported per mode: TTFT p50/p90 over all requests and over those with at
least half their prompt from host memory (the stream's first chunk, timed
here), prompt tokens from device / host / computed (SGLang's own
`cached_tokens_details`), whether every request's greedy output equals the
`none` run's, the engine's start time, and the error where a mode failed;
for hicache-cp, its restore checks (`restore_checks`: pages checked per
tier, failures per tier and part), scraped from the plug-in's metrics
endpoint in SGLang's scheduler process (`HICACHE_CP_METRICS_PORT`) after
the last request.
JSON with commit, machine and command; one line per mode on stdout as it
finishes.

`--check-args` starts no engine: each mode's arguments go through SGLang's own
`ServerArgs` and its resolution (what `sglang.Engine` does before it starts a
process), with the plug-in loaded through SGLang's plug-in entry point; where
there is no GPU, torch claims one (an H100) and the `sgl_kernel` stand-in is on
the path, as `bench/engines/sglang_pack.py trace` does. It prints each mode's resolved
cache and attention settings and fails on the first argument SGLang refuses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hicache_harness.outputs import write_json  # noqa: E402
from hicache_harness.provenance import git_commit, machine  # noqa: E402
from hicache_harness.sessions import run_in_session  # noqa: E402

MODES = ("hicache-cp", "sglang-hicache", "none")
PAGE = 64

MODELS: dict[str, dict[str, Any]] = {
    # A dense DeepSeek-V3: MLA at DeepSeek's latent widths (512 + 64), 8 layers of dense MLP.
    "deepseek": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 1024,
        "intermediate_size": 4096, "moe_intermediate_size": 512, "num_hidden_layers": 8,
        "num_nextn_predict_layers": 0, "num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 8, "moe_layer_freq": 1, "kv_lora_rank": 512,
        "q_lora_rank": 768, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "vocab_size": 32000, "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    },
    # A Llama with grouped-query attention (8 heads, 2 KV heads of 128).
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "vocab_size": 32000, "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    },
}  # fmt: skip

#: SGLang's own switches away from sgl-kernel (bench/engines/sglang_shims/README.md).
ENGINE_ENV = {"SGLANG_FORCE_FUSED_OP_BACKEND": "torch", "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
              "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def token_bytes(config: dict[str, Any]) -> int:
    """KV bytes of one token over every layer (bf16): MLA latent + rope, or K and V."""
    layers = config["num_hidden_layers"]
    if "kv_lora_rank" in config:
        return layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    return layers * 2 * config["num_key_value_heads"] * config["head_dim"] * 2


def prompts(args: argparse.Namespace) -> list[tuple[int, int, list[int]]]:
    """(group, round, token ids): each group's prefix with a new suffix per round, round-robin."""
    rng = np.random.default_rng(args.seed)
    prefixes = [rng.integers(10, 30000, args.prefix_tokens).tolist() for _ in range(args.groups)]
    out = []
    for r in range(args.rounds):
        for g in range(args.groups):
            out.append((g, r, prefixes[g] + rng.integers(10, 30000, args.suffix_tokens).tolist()))
    return out


def warmup_prompt(args: argparse.Namespace) -> list[int]:
    """One short prompt of token ids no timed prompt shares a page with (they are drawn from 10 and up)."""
    return list(range(1, 10)) * (2 * PAGE // 9 + 1)


def engine_kwargs(mode: str, args: argparse.Namespace, model_dir: Path, host_ratio: float) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        model_path=str(model_dir), skip_tokenizer_init=True, load_format="dummy", dtype="bfloat16",
        attention_backend=args.attention_backend, sampling_backend="pytorch", disable_cuda_graph=True,
        page_size=PAGE, max_total_tokens=args.device_tokens, chunked_prefill_size=4096, max_running_requests=8,
        random_seed=args.seed, log_level="warning", mem_fraction_static=0.5,
        disable_overlap_schedule=args.disable_overlap_schedule,
    )  # fmt: skip
    if mode == "hicache-cp":
        kw["radix_cache_backend"] = "hicache-cp"
    elif mode == "sglang-hicache":
        kw.update(enable_hierarchical_cache=True, hicache_ratio=host_ratio, hicache_io_backend="kernel",
                  hicache_mem_layout="page_first", hicache_write_policy="write_through")  # fmt: skip
    return kw


RESOLVED = ("attention_backend", "sampling_backend", "radix_cache_backend", "enable_hierarchical_cache",
            "hicache_ratio", "hicache_io_backend", "hicache_mem_layout", "hicache_write_policy", "page_size",
            "max_total_tokens", "chunked_prefill_size", "disable_cuda_graph", "disable_overlap_schedule")  # fmt: skip


def check_args(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each mode's engine arguments through SGLang's `ServerArgs(**kwargs)` and
    `resolve_once()` (see the module docstring); one record per mode, with the error
    where SGLang refused them."""
    import torch

    if not torch.cuda.is_available():
        here = Path(__file__).resolve().parent
        sys.path[:0] = [str(here / "sglang_shims"), str(here)]
        import sglang_pack

        sglang_pack.fake_cuda_for_imports()
    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # as sglang.Engine does first: hicache-cp registers through its entry point
    out = []
    with tempfile.TemporaryDirectory(prefix="sglang-engine-args-") as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(MODELS[args.model]))
        for mode in args.modes:
            row: dict[str, Any] = {"mode": mode, "model": args.model}
            try:
                kwargs = engine_kwargs(mode, args, model_dir, args.host_ratio)
                check_cli_values(kwargs)
                server_args = ServerArgs(**kwargs)
                server_args.resolve_once()
                row["resolved"] = {k: getattr(server_args, k) for k in RESOLVED}
                backend = server_args.radix_cache_backend
                if backend is not None and get_radix_cache_factory(backend) is None:
                    raise ValueError(f"--radix-cache-backend {backend}: not registered by any loaded plug-in")
            except Exception as exc:  # noqa: BLE001 - the outcome is the record
                row["error"] = f"{type(exc).__name__}: {exc}"[:800]
            out.append(row)
    return out


def check_cli_values(kwargs: dict[str, Any]) -> None:
    """Each value against SGLang's own command-line definition of its argument (choices
    and type; `ServerArgs(**kwargs)` checks the names only). Raises ValueError naming the
    argument; arguments without a command line (`no_cli` fields) are left to ServerArgs."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    actions = {a.dest: a for a in parser._actions}  # noqa: SLF001 - argparse keeps no public map
    for key, value in kwargs.items():
        action = actions.get(key)
        if action is None or isinstance(value, bool):
            continue
        flag = action.option_strings[0] if action.option_strings else key
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"{flag} {value!r}: SGLang accepts {sorted(map(str, action.choices))}")
        if callable(action.type):
            try:
                action.type(str(value))
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"{flag} {value!r}: {exc}") from exc


def run_child(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode in this process: the engine, the prompts, the measurements."""
    import sglang

    config = MODELS[args.model]
    out: dict[str, Any] = {"mode": mode, "model": args.model}
    with tempfile.TemporaryDirectory(prefix="sglang-engine-") as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(config))
        host_bytes = int(args.host_ratio * args.device_tokens) * token_bytes(config)
        out["host_bytes"] = host_bytes
        port = 0
        if mode == "hicache-cp":
            os.environ["HICACHE_HOST_BUDGET_BYTES"] = str(host_bytes)
            port = free_port()
            os.environ["HICACHE_CP_METRICS_PORT"] = str(port)  # TP rank 0 serves on port + 0
        t0 = time.perf_counter()
        engine = sglang.Engine(**engine_kwargs(mode, args, model_dir, args.host_ratio))
        out["start_s"] = time.perf_counter() - t0
        try:
            # Untimed: the first forward's one-time costs (kernel builds, whose on-disk caches
            # the first mode of a run would otherwise pay alone) stay out of every mode's TTFT.
            out["warmup_ttft_ms"] = serve_one(engine, -1, -1, warmup_prompt(args), args.new_tokens)["ttft_ms"]
            out["requests"] = [serve_one(engine, g, r, ids, args.new_tokens) for g, r, ids in prompts(args)]
            if port:
                out["restore_checks"] = scrape_restore_checks(port)
        finally:
            engine.shutdown()
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the metrics endpoint binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_SAMPLE = re.compile(r'^sglang:hicache_integrity_(checked_pages|failures)_total\{([^}]*)\} ([0-9.e+]+)$')


def restore_checks(metrics_text: str) -> dict[str, Any]:
    """The restore checks in a scrape of the plug-in's endpoint (Prometheus text):
    {"checked_pages": {tier: n}, "failures": {tier: {part: n}}}."""
    out: dict[str, Any] = {"checked_pages": {}, "failures": {}}
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        n = int(float(m.group(3)))
        if m.group(1) == "checked_pages":
            out["checked_pages"][labels["tier"]] = n
        else:
            out["failures"].setdefault(labels["tier"], {})[labels["part"]] = n
    return out


def scrape_restore_checks(port: int) -> dict[str, Any]:
    """`restore_checks` of http://127.0.0.1:`port`/metrics, or {"error": why} (the record says
    the checks went uncounted rather than failing the run)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return restore_checks(reply.read().decode())
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def serve_one(engine: Any, group: int, rnd: int, ids: list[int], new_tokens: int) -> dict[str, Any]:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    first = None
    last: dict[str, Any] = {}
    for chunk in engine.generate(input_ids=ids, sampling_params=params, stream=True):
        if first is None:
            first = time.perf_counter() - t0
        last = chunk
    meta = last.get("meta_info", {})
    details = meta.get("cached_tokens_details") or {}
    device, host = int(details.get("device", 0)), int(details.get("host", 0))
    cached = int(meta.get("cached_tokens", device + host))
    return {"group": group, "round": rnd, "prompt_tokens": len(ids), "ttft_ms": (first or 0.0) * 1e3,
            "e2e_ms": (time.perf_counter() - t0) * 1e3, "device_tokens": device, "host_tokens": host,
            "computed_tokens": len(ids) - cached, "output_ids": list(last.get("output_ids", []))}  # fmt: skip


def half_from_host(requests: list[dict[str, Any]]) -> list[float]:
    """TTFTs of the requests with at least half their prompt from host (the bench's host hits)."""
    return [q["ttft_ms"] for q in requests if q["host_tokens"] * 2 >= q["prompt_tokens"]]


def summarise(rows: dict[str, dict[str, Any]]) -> None:
    """TTFT percentiles, token sources and greedy agreement with the `none` run, per mode."""
    reference = {(q["group"], q["round"]): q["output_ids"] for q in rows.get("none", {}).get("requests", [])}
    for row in rows.values():
        reqs = row.get("requests")
        if not reqs:
            continue
        ttft = np.array([q["ttft_ms"] for q in reqs])
        half = np.array(half_from_host(reqs))
        row.update(
            ttft_p50_ms=float(np.percentile(ttft, 50)), ttft_p90_ms=float(np.percentile(ttft, 90)),
            half_from_host_requests=len(half),
            half_from_host_ttft_p50_ms=float(np.percentile(half, 50)) if len(half) else None,
            half_from_host_ttft_p90_ms=float(np.percentile(half, 90)) if len(half) else None,
            prompt_tokens=sum(q["prompt_tokens"] for q in reqs), device_tokens=sum(q["device_tokens"] for q in reqs),
            host_tokens=sum(q["host_tokens"] for q in reqs), computed_tokens=sum(q["computed_tokens"] for q in reqs),
        )  # fmt: skip
        if reference:
            differ = [[q["group"], q["round"]] for q in reqs if reference.get((q["group"], q["round"])) != q["output_ids"]]
            row["greedy_identical_to_none"] = not differ
            row["greedy_differs"] = differ[:10]


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| mode | TTFT p50 / p90 ms | >= half from host: n, TTFT p50 / p90 ms | prompt tokens device / host / computed "
             "| greedy == none | restore checks: pages checked / failed | start s |", "|" + "---|" * 7]  # fmt: skip
    for mode, r in rows.items():
        if "ttft_p50_ms" not in r:
            lines.append(f"| {mode} | not run: {r.get('error', '?')} |" + " |" * 5)
            continue

        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        lines.append(
            f"| {mode} | {r['ttft_p50_ms']:.1f} / {r['ttft_p90_ms']:.1f} | {r['half_from_host_requests']}, "
            f"{ms(r['half_from_host_ttft_p50_ms'])} / {ms(r['half_from_host_ttft_p90_ms'])} | {r['device_tokens']:,} / "
            f"{r['host_tokens']:,} / {r['computed_tokens']:,} | {r.get('greedy_identical_to_none', '-')} | "
            f"{_checks_cell(r.get('restore_checks'))} | {r['start_s']:.0f} |"
        )
    return "\n".join(lines)


def _checks_cell(checks: dict[str, Any] | None) -> str:
    if not checks:
        return "-"
    if "error" in checks:
        return f"not scraped: {checks['error']}"
    failed = sum(n for parts in checks["failures"].values() for n in parts.values())
    return f"{sum(checks['checked_pages'].values()):,} / {failed:,}"


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode in a child process (its own engine and GPU memory, under `args.timeout`): its
    record, or its error with the child's output tail; `wall_s` either way, and
    `leftover_processes`: how many of the child's processes (SGLang's scheduler and
    detokenizer) outlived it and were killed, so none holds the GPU while the next mode runs."""
    cmd = [sys.executable, __file__, "--child", mode, *_without(sys.argv[1:], "--json", "--modes", "--no-prime")]
    t0 = time.perf_counter()
    child = run_in_session(cmd, args.timeout)
    if child.returncode is None:
        row: dict[str, Any] = {"mode": mode, "error": f"timed out after {args.timeout} s"}
    else:
        line = next((ln for ln in reversed(child.stdout.splitlines()) if ln.startswith("RESULT ")), None)
        row = json.loads(line[7:]) if line else {"mode": mode, "error": f"exit {child.returncode}, no result"}
    if "error" in row or child.returncode:
        row["stderr_tail"] = child.stderr[-4000:]
    row["wall_s"] = time.perf_counter() - t0
    row["leftover_processes"] = child.leftover
    return row


def _without(argv: list[str], *flags: str) -> list[str]:
    """`argv` without each of `flags` and the values that follow it."""
    out, skip = [], False
    for a in argv:
        if a in flags or any(a.startswith(f + "=") for f in flags):
            skip = "=" not in a
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        out.append(a)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek", choices=sorted(MODELS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--suffix-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--device-tokens", type=int, help="device KV tokens (default: about two prompts, page-aligned)")
    ap.add_argument("--host-ratio", type=float, default=4.0, help="SGLang's --hicache-ratio; hicache-cp gets those bytes")
    ap.add_argument("--attention-backend", default="triton", choices=["triton", "torch_native"])
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per mode")
    ap.add_argument("--quick", action="store_true", help="2 groups x 2 rounds of 1,024-token prefixes (smoke)")
    ap.add_argument("--check-args", action="store_true", help="check every mode's arguments with SGLang's ServerArgs; start nothing")
    ap.add_argument("--no-prime", dest="prime", action="store_false",
                    help="skip the untimed priming run of `none` before the timed modes (it builds the "
                         "kernels every mode uses, whose on-disk caches the first timed mode would pay for alone)")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.groups, args.rounds, args.prefix_tokens, args.suffix_tokens = 3, 2, 1024, 128
    if args.device_tokens is None:
        prompt = args.prefix_tokens + args.suffix_tokens + args.new_tokens
        args.device_tokens = -(-int(prompt * 2.2) // PAGE) * PAGE
    os.environ.update({k: v for k, v in ENGINE_ENV.items() if k not in os.environ})
    if args.check_args:
        checked = check_args(args)
        for row in checked:
            print(json.dumps(row, default=str), flush=True)
        return 1 if any("error" in row for row in checked) else 0
    if args.child:
        try:
            row = run_child(args.child, args)
        except BaseException as exc:  # noqa: BLE001 - the outcome is the record (the parent prints it)
            import traceback

            row = {"mode": args.child, "error": f"{type(exc).__name__}: {exc}"[:800], "traceback": traceback.format_exc()[-3000:]}
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    prime = None
    if args.prime:  # untimed: the on-disk kernel caches filled before any timed mode
        print("-- none (priming, untimed)", flush=True)
        prime = {k: v for k, v in run_mode("none", args).items() if k in ("wall_s", "error", "leftover_processes")}
    rows: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        print(f"-- {mode}", flush=True)
        row = rows[mode] = run_mode(mode, args)
        print(json.dumps({k: v for k, v in row.items() if k not in ("requests", "stderr_tail", "traceback")}), flush=True)
        if "error" in row:
            print(row.get("traceback") or row.get("stderr_tail", ""), flush=True)
        summarise(rows)
        if args.json:  # after every mode: a call cut short keeps the modes that ran
            command = " ".join(["bench/engines/sglang_engine.py", *sys.argv[1:]])
            write_json(args.json, {"commit": git_commit(), "machine": machine(), "command": command,
                                   "model": MODELS[args.model], "modes": rows, "prime": prime,
                                   "config": {k: v for k, v in vars(args).items() if k != "json"}})  # fmt: skip
    print(table(rows))
    ok = all("error" not in r and r.get("greedy_identical_to_none", True) for r in rows.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
