"""`hicache-cp replay --engine hf`: a real model's prefill server with hicache-cp as its L2.

The engine builds transformers' DeepSeek-V3.2 with random weights (`hf_model`),
derives the cache layout from it, hands the cache its own typed L1 buffers,
and serves the trace with a batching, chunking scheduler (`scheduler`) whose
forward calls the decoder layers one by one (`hf_forward`). What it reports
besides the replay's usual keys:

    ttft_p50_s / _p90_s / _p99_s   arrival -> first token, every served request
    prefill_tokens_per_s           tokens computed / time in forwards
    prefill_compute_saved          1 - tokens computed / prompt tokens
    max_batch_requests             the most sequences one forward held
    outputs_checked / _max_abs_err / _mismatches
                                   the output oracle (`hf_oracle`) on --check-outputs N
                                   hit requests, against the model's own full forward
    draft_outputs_checked / _max_abs_err / _mismatches / _near_ties
                                   the same requests' MTP draft: last-token logits against
                                   the draft over a recompute, both fed the served first
                                   token (a proposed token that differs within the
                                   tolerance is a near tie, not a mismatch)
    spec_checked / _mismatches / _near_ties / spec_accept_mean_restored / _recomputed, spec_checks
                                   --spec-steps steps of greedy MTP speculation from a
                                   recompute and, fed the same tokens, from the restored
                                   prefix (`hf_spec`), per request the accept lengths, tokens
                                   and proposals of both and the near-tie picks
    loads_refused, integrity_refused_units, integrity_restore_checked_units
                                   restored pages checked before use (`hf_oracle.RestoreGuard`)
    faults_injected                what --hf-fault fired (`hf_faults`)
    cp_exchange_collectives / _bytes
                                   CP: the prefix all-gathers of this rank (`hf_cp`)
    ttft_hit_over_recompute        requests with >= 90% hits: their TTFT over the time
                                   this engine takes to compute the same prompt without
                                   the cache (median; `_p90`, and the samples)
    load_over_pcie_bound           the same requests' load time over their bytes / the
                                   measured copy peak (median over those that loaded)
    no_l2                          with --compare-no-l2: the same trace with L2 off
    ttft_l2_over_l1_hit / _p90, ttft_l2_over_l1_hit_pairs, ttft_probe_pairs / _valid_pairs,
    layer_forward_ms, ttft_probe_wall_s (or ttft_probe_error)
                                   with --ttft-probe N: L2-hit over L1-hit TTFT of matched
                                   pairs, and layer times with and without copies (`hf_probe`)

The byte oracle (`integrity_*` keys) covers every reused page of every part
and layer; its digests are recorded when pages are computed.

With `--cp-size N` each rank is one process (`replay.multirank`) running
this engine over its own share of L1 and L2 (`hf_cp`): the forward is
replicated and reads the full prefix through a per-layer all-gather of the
ranks' owned pages; every oracle runs on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from hicache_cp.cache import HiCache
from hicache_cp.config import Config, WritePolicy
from hicache_cp.cp.agreement import Agreement
import hicache_harness.engines.hf_model as hf_model
import hicache_harness.engines.hf_options as hf_options
import hicache_harness.engines.hf_probe as hf_probe
from hicache_harness.engines.base import EngineRun, RunOptions, progress_bar
from hicache_harness.engines.hf_cp import PrefixExchange, make_view
from hicache_harness.engines.hf_faults import FaultInjector, HfFault, check_faults
from hicache_harness.engines.hf_forward import PagedForward, ScratchKV, SeqChunk, SeqPlan
from hicache_harness.engines.hf_oracle import OutputCheck, compare_logits, recompute_outputs
from hicache_harness.engines.hf_spec import OracleSamples, Sample, Speculator, spec_report
from hicache_harness.engines.hf_timing import Clock, copy_peak_gbps
from hicache_harness.engines.scheduler import Arrivals, Order, Scheduler, SchedulerOptions, ServeResult
from hicache_harness.engines.sequences import RequestRecord
from hicache_harness.trace import TraceRequest, request_tokens
from hicache_cp.pools import DevicePool

logger = logging.getLogger(__name__)

HIT90 = 0.9  # "requests that are at least 90% hits"


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields the model fixes: its cache layout and page size."""
    p = hf_model.preset(args.hf_preset)
    return {"model_layout": hf_model.layout_of(p.name), "page_size": p.page_size}


def model_bytes(args: argparse.Namespace) -> int:
    """Memory one rank's model takes to build, where it is built (`hf_model.build_bytes`)."""
    return hf_model.build_bytes(hf_model.preset(args.hf_preset).name)


class HfEngine:
    """The `Engine` of a real model; see the module docstring."""

    name = "hf"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.preset = hf_model.preset(args.hf_preset)
        hf_options.check(args, self.preset.page_size)
        self.chunk_tokens = args.chunk_tokens or self.preset.chunk_tokens
        self.max_batch_tokens = args.max_batch_tokens or self.preset.max_batch_tokens
        self._model: hf_model.HfModel | None = None
        self._buffers: dict[int, dict[Any, list[torch.Tensor]]] = {}
        self.faults = [HfFault.parse(f) for f in getattr(args, "hf_fault", None) or ()]

    # ---- Engine protocol ---------------------------------------------------------------------

    def configure(self, args: argparse.Namespace, config: Config, requests: list[TraceRequest]) -> Config:
        """Check that the replay's setup resolved the config with `config_overrides`
        (this model's layout and page size, applied before sizing); return it."""
        hf_options.check_cp_size(args, config.cp_size)
        check_faults(self.faults, config)
        over = config_overrides(args)
        if config.model_layout != over["model_layout"] or config.page_size != over["page_size"]:
            raise ValueError(
                f"the config was not resolved for --engine hf: layout {config.model_layout}, page size "
                f"{config.page_size}; the replay's setup must merge engines.config_overrides(args) before sizing"
            )
        return config

    def open_cache(self, config: Config, *, rank: int, agreement: Agreement | None, device: str) -> HiCache:
        model = self.model(device)
        buffers = model.kv_buffers(config.l1_pages)
        pool = DevicePool(config.layout(), config.l1_pages, cp_size=config.cp_size, rank=rank, buffers=buffers)
        cache = HiCache(config, device_pool=pool, rank=rank, agreement=agreement, device=device)
        self._buffers[id(cache)] = buffers
        return cache

    def run(self, cache: HiCache, requests: list[TraceRequest], opts: RunOptions) -> EngineRun:
        """Serve `requests` on this rank (every CP rank calls it with the same requests)."""
        model = self.model(str(cache.device_pool.device))
        work = [(r, request_tokens(r, opts.tokens_per_block, vocab_size=model.vocab_size)) for r in requests]
        longest = max((len(ids) for _, ids in work), default=0)
        if longest > hf_model.DENSE_INDEX_TOPK:
            raise ValueError(f"a prompt of {longest} tokens exceeds the index top-k {hf_model.DENSE_INDEX_TOPK}")
        bar = progress_bar(list(range(len(work))), opts.progress, desc="hf replay")
        ticks = iter(bar) if opts.progress else None

        def done(i: int) -> None:
            opts.on_request(i)
            if ticks is not None:
                next(ticks, None)

        threads = self.preset.cpu_threads if model.device.type == "cpu" else None
        with _torch_threads(threads):
            self._time_recompute(model, np.arange(self.chunk_tokens + 1) % model.vocab_size)  # warm-up: kernels, allocator
            injector = FaultInjector(cache, self.faults) if self.faults else None
            samples = OracleSamples(
                self.args.check_outputs, snapshots=self.args.spec_steps > 0, buffers=self._buffers[id(cache)],
                rank=cache.rank, cp_size=cache.cp_size, page_size=cache.layout.page_size,
                flagged=injector.requests if injector is not None else frozenset(),
            )  # fmt: skip
            exchange = PrefixExchange(model, cache.rank, cache.cp_size)
            result = self._serve(cache, work, sink=opts.sink, verify=opts.verify, use_l2=True, on_request=done,
                                 exchange=exchange, samples=samples, injector=injector)  # fmt: skip
            if hasattr(bar, "close"):
                bar.close()
            extra = self._report(model, cache, work, result, samples, exchange)
            if self.args.ttft_probe:
                extra.update(self._probe(model, cache.config, work))
            if injector is not None:
                extra["faults_injected"] = injector.injected
            other = self._compare_no_l2(cache.config, work, opts.verify) if self.args.compare_no_l2 else None
        integ = result.integrity
        checked, units, expected, mism = integ.checked_pages, integ.checked_units, integ.expected_units, integ.mismatches
        examples = [str(m) for m in integ.examples[:10]]
        if other is not None:
            extra["no_l2"] = other["summary"]
            extra["ttft_p50_over_no_l2"] = _ratio(extra["ttft_p50_s"], other["summary"]["ttft_p50_s"])
            o = other["integrity"]
            checked, units = checked + o.checked_pages, units + o.checked_units
            expected, mism = expected + o.expected_units, mism + o.mismatches
            examples += [f"no-L2 run: {m}" for m in o.examples[:5]]
        return EngineRun(checked, units, expected, mism, examples, result.rejected, extra)

    # ---- pieces --------------------------------------------------------------------------------

    def model(self, device: str) -> hf_model.HfModel:
        if self._model is None:
            self._model = hf_model.build(self.preset.name, device, seed=self.args.hf_seed)
        return self._model

    def _options(self, *, use_l2: bool, verify: bool, arrivals: Arrivals | None = None) -> SchedulerOptions:
        return SchedulerOptions(
            chunk_tokens=self.chunk_tokens, max_batch_tokens=self.max_batch_tokens,
            arrivals=arrivals or Arrivals(self.args.arrivals), time_scale=self.args.time_scale, use_l2=use_l2,
            verify=verify, order=Order(self.args.schedule),
        )  # fmt: skip

    def _serve(
        self, cache: HiCache, work: list[tuple[TraceRequest, np.ndarray]], *, sink: Any, verify: bool, use_l2: bool,
        on_request: Callable[[int], None], exchange: PrefixExchange | None = None, samples: OracleSamples | None = None,
        injector: FaultInjector | None = None, arrivals: Arrivals | None = None, forward: PagedForward | None = None,
    ) -> ServeResult:  # fmt: skip
        model = self.model(str(cache.device_pool.device))
        buffers = self._buffers[id(cache)]
        scheduler = Scheduler(
            cache, forward or PagedForward(model), buffers, self._options(use_l2=use_l2, verify=verify, arrivals=arrivals),
            sink=sink, on_request=on_request, view=make_view(model, buffers, cache.rank, cache.cp_size, exchange),
            on_finish=samples.offer if samples is not None else None,
            before_load=injector.before_load if injector is not None else None,
        )  # fmt: skip
        return scheduler.serve(work)

    def _probe(self, model: hf_model.HfModel, config: Config, work: list[tuple[TraceRequest, np.ndarray]]) -> dict[str, Any]:
        """`--ttft-probe N` (`hf_probe`) on a cache of its own (the replay's config, write-through,
        no L3: the replay's cache and counters are left as the replay made them), over the
        longest prompts that fit half of L1 (so that a prefix computed once stays in L1
        whole until it is evicted on purpose)."""
        d = config.to_dict()
        cfg = Config.from_dict({**d, "write_policy": WritePolicy.WRITE_THROUGH.value, "l2_exclusive": False,
                                "l3": {**d["l3"], "backend": "none"}})  # fmt: skip
        room = cfg.l1_pages * cfg.page_size // 2
        fitting = sorted((ids for _, ids in work if len(ids) <= room), key=len, reverse=True)
        prompts = fitting[: self.args.ttft_probe]
        if not prompts:  # the replay's results stand; the probe's absence is said, loudly
            logger.warning("--ttft-probe: no prompt of the trace fits half of L1 (%d tokens); no probe", room)
            return {"ttft_probe_error": f"no prompt of the trace fits half of L1 ({room} tokens)"}
        t0 = time.perf_counter()
        try:
            out = self._run_probe(model, cfg, work, prompts)
            out["ttft_probe_wall_s"] = round(time.perf_counter() - t0, 3)
            return out
        except Exception as e:  # noqa: BLE001 - the one boundary of the probe: the replay's results stand
            logger.exception("--ttft-probe failed; the replay's results are reported without it")
            return {"ttft_probe_error": f"{type(e).__name__}: {e}"}

    def _run_probe(
        self, model: hf_model.HfModel, cfg: Config, work: list[tuple[TraceRequest, np.ndarray]], prompts: list[np.ndarray]
    ) -> dict[str, Any]:  # fmt: skip
        forward = hf_probe.TimedForward(model)
        with self.open_cache(cfg, rank=0, agreement=None, device=str(model.device)) as cache:
            try:

                def serve_one(req: TraceRequest, ids: np.ndarray) -> hf_probe.Served:
                    forward.take_ms()  # nothing of an earlier request
                    result = self._serve(cache, [(req, ids)], sink=None, verify=False, use_l2=True,
                                         on_request=lambda i: None, arrivals=Arrivals.ASAP, forward=forward)  # fmt: skip
                    return hf_probe.Served(result.records[-1], forward.take_ms())

                first = max(r.index for r, _ in work) + 1
                out = hf_probe.ttft_pairs(serve_one, cache, prompts, vocab_size=model.vocab_size,
                                          seed=self.args.hf_seed + 2, first_index=first)  # fmt: skip
                ps = cache.layout.page_size
                copy_pages = int(len(prompts[0]) * hf_probe.HIT_FRACTION) // ps  # what an L2 hit of it loads a layer
                out["layer_forward_ms"] = hf_probe.layer_times(model, cache, prompts[0], self.chunk_tokens, copy_pages)
                out["layer_forward_ms"]["hit_pairs"] = out.pop("layer_forward_ms_hit_pairs")
                cache.drain()
                cache.check_invariants()
            finally:
                self._buffers.pop(id(cache), None)
        return out

    def _compare_no_l2(self, config: Config, work: list[tuple[TraceRequest, np.ndarray]], verify: bool) -> dict[str, Any]:
        """The same trace on a fresh cache that never backs up (L2 holds nothing)."""
        assert self._model is not None
        model = self._model
        cfg = Config.from_dict({**config.to_dict(), "write_policy": WritePolicy.WRITE_THROUGH.value})
        with self.open_cache(cfg, rank=0, agreement=None, device=str(model.device)) as cache:
            result = self._serve(cache, work, sink=None, verify=verify, use_l2=False, on_request=lambda i: None)
            cache.drain()
            stats = cache.stats()
            self._buffers.pop(id(cache), None)
        summary = {k: stats[k] for k in ("prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "miss_tokens", "hit_rate")}
        summary.update(_serving_summary(result))
        return {"summary": summary, "integrity": result.integrity}

    def _report(
        self, model: hf_model.HfModel, cache: HiCache, work: list[tuple[TraceRequest, np.ndarray]], result: ServeResult,
        samples: OracleSamples, exchange: PrefixExchange,
    ) -> dict[str, Any]:  # fmt: skip
        peak, peak_source = copy_peak_gbps(model.device)
        out: dict[str, Any] = {
            "engine": "hf",
            "model": f"hf-{self.preset.name}",
            "hf_preset": self.preset.name,
            "dtype": self.preset.dtype,
            "attention": self.preset.attn,
            "device": str(model.device),
            "chunk_tokens": self.chunk_tokens,
            "max_batch_tokens": self.max_batch_tokens,
            "schedule": self.args.schedule,
            "arrivals": self.args.arrivals,
            "time_scale": self.args.time_scale,
            "index_topk": hf_model.DENSE_INDEX_TOPK,
            "layout": cache.layout.describe(),
            "io_backend": cache.engine.name,
            "io_copies": dict(getattr(cache.engine, "counts", {})),  # kernel / DMA split of the CUDA backends
            "copy_peak_gbps": round(peak, 3),
            "copy_peak_source": peak_source,
            "integrity_checked_l2_units": result.integrity.checked_l2_units,
            "integrity_digest_variants": result.integrity.digest_variants,
            "integrity_restore_checked_units": result.integrity.restore_checked_units,
            "integrity_refused_units": result.integrity.refused_units,
            "loads_refused": result.integrity.refused_loads,
            "cp_exchange_collectives": exchange.collectives,
            "cp_exchange_bytes": exchange.bytes_sent,
        }
        out.update(_serving_summary(result))
        ids = {r.index: t for r, t in work}
        chosen = samples.chosen()
        out.update(self._output_oracle(model, result, chosen))
        out.update(self._spec_oracle(model, chosen, exchange))
        out.update(self._hit90(model, result, ids, peak))
        out["per_request"] = [_record_row(r) for r in result.records]
        return out

    def _output_oracle(self, model: hf_model.HfModel, result: ServeResult, chosen: list[Sample]) -> dict[str, Any]:
        """Oracle (b): the sampled hit requests' target and draft outputs against a full recompute."""
        p = self.preset
        checks: list[OutputCheck] = []
        for s in chosen:
            served = result.logits[s.request]
            ref, draft_ref = recompute_outputs(model, s.ids, self.chunk_tokens, next_token=int(served.argmax()))
            err, tol, same = compare_logits(served, ref, p.logits_atol, p.logits_rtol)
            served_draft = result.draft_logits[s.request]
            d_err, d_tol, d_same = compare_logits(served_draft, draft_ref, p.logits_atol, p.logits_rtol)
            check = OutputCheck(s.request, len(s.ids), s.reused_pages * p.page_size, s.restored_pages * p.page_size,
                                err, tol, same, d_err, d_tol, d_same)  # fmt: skip
            checks.append(check)
            if not check.ok:
                logger.warning("output mismatch: request %d max |logit diff| %.3g > %.3g", s.request, err, tol)
            if not check.draft_ok:
                logger.warning("draft output mismatch: request %d max |draft logit diff| %.3g > %.3g, "
                               "same proposed token: %s", s.request, d_err, d_tol, d_same)  # fmt: skip
        return {
            "outputs_checked": len(checks),
            "outputs_max_abs_err": max((c.max_abs_err for c in checks), default=0.0),
            "outputs_mismatches": sum(not c.ok for c in checks),
            "outputs_same_argmax": sum(c.same_argmax for c in checks),
            "outputs_tolerance": f"|restored - recompute| <= {p.logits_atol} + {p.logits_rtol} * max|recompute|",
            "draft_outputs_checked": len(checks),
            "draft_outputs_max_abs_err": max((c.draft_max_abs_err for c in checks), default=0.0),
            "draft_outputs_mismatches": sum(not c.draft_ok for c in checks),
            "draft_outputs_same_token": sum(c.draft_same_token for c in checks),
            "draft_outputs_near_ties": sum(c.draft_near_tie for c in checks),
            "output_checks": [dataclasses.asdict(c) for c in checks],
        }

    def _spec_oracle(self, model: hf_model.HfModel, chosen: list[Sample], exchange: PrefixExchange) -> dict[str, Any]:
        """Speculation from each sample's restored prefix and from a recompute (`hf_spec`)."""
        steps = self.args.spec_steps
        if not steps or not chosen:
            return spec_report([], steps)
        spec = Speculator(PagedForward(model), self.chunk_tokens, steps)
        stores = spec.restored_prefixes(exchange, chosen)  # collectives: every rank, same samples
        checks = []
        for s, store in zip(chosen, stores):
            start = s.snapshot.tokens if s.snapshot is not None else 0
            check = spec.check(s.request, s.ids, store, start, self.preset.logits_atol, self.preset.logits_rtol)
            if not check.same:
                logger.warning("speculation differs: request %d max |logit diff| %.3g (tolerance %.3g), picks "
                               "decided differently %s; restored %s, recomputed %s", s.request, check.max_abs_err,
                               check.tolerance, check.decided_differently, check.restored, check.recomputed)  # fmt: skip
            checks.append(check)
        return spec_report(checks, steps)

    def _hit90(
        self, model: hf_model.HfModel, result: ServeResult, ids: dict[int, np.ndarray], peak_gbps: float
    ) -> dict[str, Any]:
        """Requests with >= 90% hits: TTFT against a recompute, load time against the copy peak."""
        hit90 = [r for r in result.records if r.served and r.hit_fraction >= HIT90]
        rng = np.random.default_rng(self.args.hf_seed + 1)
        sample = [hit90[i] for i in sorted(rng.permutation(len(hit90))[: self.args.recompute_samples])]
        ratios, samples = [], []
        for rec in sample:
            recompute_s = self._time_recompute(model, ids[rec.request])
            ratios.append(rec.ttft_s / recompute_s)
            samples.append({"request": rec.request, "prompt_tokens": rec.prompt_tokens, "hit_fraction": round(rec.hit_fraction, 4),
                            "ttft_s": rec.ttft_s, "recompute_s": recompute_s, "ratio": rec.ttft_s / recompute_s})  # fmt: skip
        loads = [r for r in hit90 if r.load_s is not None and r.load_bytes]
        load_ratios = [r.load_s / (r.load_bytes / (peak_gbps * 1e9)) for r in loads]  # type: ignore[operator]
        return {
            "hit90_requests": len(hit90),
            "ttft_hit_over_recompute": _pct(ratios, 50),
            "ttft_hit_over_recompute_p90": _pct(ratios, 90),
            "recompute_samples": samples,
            "hit90_loads": len(loads),
            "load_over_pcie_bound": _pct(load_ratios, 50),
            "load_over_pcie_bound_p90": _pct(load_ratios, 90),
            "load_samples": [{"request": r.request, "load_s": r.load_s, "load_bytes": r.load_bytes,
                              "load_submit_s": r.load_submit_s} for r in loads[:20]],  # fmt: skip
        }

    def _time_recompute(self, model: hf_model.HfModel, ids: np.ndarray) -> float:
        """Seconds this engine takes to prefill `ids` alone without the cache
        (same chunking, no paging, no hooks) to its first token."""
        forward = PagedForward(model)
        clock = Clock(model.device)
        store = ScratchKV()
        t0 = clock.sync()
        pos = 0
        while pos < len(ids):
            end = min(len(ids), pos + self.chunk_tokens)
            nxt = None if end == len(ids) else int(ids[end])
            plan = SeqPlan.build(SeqChunk(ids[pos:end], pos, None, 0, 0, nxt), model.preset.page_size)
            r = forward.run([(plan, store.bind(plan))])
            pos = end
        r.logits.cpu()
        return clock.sync() - t0


def _serving_summary(result: ServeResult) -> dict[str, Any]:
    served = [r for r in result.records if r.served]
    ttft = [r.ttft_s for r in served]
    prompt = sum(r.prompt_tokens for r in served)
    b = result.batches
    return {
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "queue_p50_s": _pct([r.admitted_s - r.arrival_s for r in served], 50),
        "prefill_tokens_computed": b.computed_tokens,
        "prefill_forward_s": round(b.forward_s, 4),
        "prefill_tokens_per_s": round(b.computed_tokens / b.forward_s, 1) if b.forward_s else None,
        "prefill_compute_saved": round(1 - b.computed_tokens / prompt, 4) if prompt else None,
        "forwards": b.forwards,
        "max_batch_requests": b.max_batch_requests,
        "mean_batch_requests": round(b.batch_requests_sum / b.forwards, 3) if b.forwards else 0,
        "max_batch_tokens_seen": b.max_batch_tokens,
        "served_requests": len(served),
        "rejected_requests": result.rejected,
        "restarted_requests": result.restarts,
        "redone_requests": result.redone,
        "serve_wall_s": round(result.wall_s, 3),
    }


def _record_row(r: RequestRecord) -> dict[str, Any]:
    return {
        "request": r.request, "prompt_tokens": r.prompt_tokens, "l1_hit_pages": r.l1_hit_pages,
        "l2_hit_pages": r.l2_hit_pages, "computed_tokens": r.computed_tokens, "ttft_s": round(r.ttft_s, 6),
        "queue_s": round(r.admitted_s - r.arrival_s, 6), "load_s": r.load_s, "served": r.served,
        "redone": r.redone, "restarts": r.restarts,
    }  # fmt: skip


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `n` for the block (unchanged for None)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
