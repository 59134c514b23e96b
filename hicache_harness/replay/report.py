"""The replay's report: bounds, the printed table and the JSON file."""

from __future__ import annotations

from typing import Any

from hicache_harness.replay.setup import Sizing
from hicache_harness.trace import TraceRequest


def compute_bounds(requests: list[TraceRequest], sizing: Sizing, pages_per_block: int) -> dict[str, Any]:
    from hicache_harness.bounds import belady_hit_rate, infinite_capacity_hit_rate

    capacity_blocks = max(1, sizing.l2_logical_pages // pages_per_block)
    inf = infinite_capacity_hit_rate(requests)
    bel = belady_hit_rate(requests, capacity_blocks)
    return {
        "infinite_capacity_hit_rate": inf.hit_rate,
        "belady_hit_rate": bel.hit_rate,
        "belady_capacity_blocks": capacity_blocks,
        "note": "block-level bounds over full blocks; the replay's hit_rate also counts partial tail tokens as misses",
    }


def integrity_failures(report: dict[str, Any]) -> list[str]:
    """Every reason this run's bytes cannot be trusted (exit code 1); [] when clean.

    Cache hits: mismatches, or byte checks that covered less than what was
    reused; outputs (target and MTP draft logits) and speculation from
    restored prefixes that differ from a recompute beyond the tolerance
    (`hf_oracle`, `hf_spec`; near ties excepted). PD: rooms that failed or
    mismatched, transfers the decode peer rejected."""
    out = []
    if report.get("integrity_mismatches"):
        out.append(f"{report['integrity_mismatches']} reused (page, part, layer) units differ from what prefill computed")
    checked, expected = report.get("integrity_checked_units"), report.get("integrity_expected_units")
    if checked is not None and checked != expected:  # with --no-verify both are 0
        out.append(f"byte checks covered {checked} of the {expected} reused (page, part, layer) units")
    for key, what in (("outputs", "outputs"), ("draft_outputs", "MTP draft outputs")):
        if report.get(f"{key}_mismatches"):
            out.append(f"the {what} of {report[f'{key}_mismatches']} of {report.get(f'{key}_checked')} sampled hit "
                       f"requests differ from a recompute beyond the tolerance")
    if report.get("spec_mismatches"):
        out.append(f"speculation from {report['spec_mismatches']} of {report.get('spec_checked')} restored prefixes "
                   f"differs from a recompute beyond the tolerance")
    if report.get("pd_failed_rooms"):
        out.append(f"{report['pd_failed_rooms']} of {report.get('pd_rooms')} PD rooms failed")
    if report.get("pd_mismatches"):
        out.append(f"{report['pd_mismatches']} PD pages differ at the decode peer")
    if report.get("verify_failures"):
        out.append(f"the library's restore checks caught {report['verify_failures']} corrupt (page, part, layer) "
                   f"units (none served: their loads aborted and the requests recomputed)")
    rejected = (report.get("pd") or {}).get("decode_rejected")
    if rejected:
        out.append(f"the decode peer rejected {rejected} transfers")
    return out


GIB = 1 << 30

# Keys the table shows in its own sections (or that are bookkeeping): not repeated under "other".
_SHOWN = {
    "requests", "prompt_tokens", "l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "miss_tokens", "hit_rate",
    "bytes_d2h", "bytes_h2d", "backups_committed", "backups_aborted", "evictions_l1", "evictions_l2",
    "integrity_checked_pages", "integrity_checked_units", "integrity_expected_units", "integrity_mismatches",
    "wall_s", "rejected_requests", "l1_capacity_pages", "l2_capacity_pages", "l2_used_pages", "host_bytes",
    "model", "policy", "write_policy", "cp_size", "tokens_per_block", "page_size", "trace", "trace_tokens",
    "footprint_pages", "l1_logical_pages", "l2_logical_pages", "commit", "machine", "command", "collectives",
    "integrity_failures", "mismatch_examples", "samples", "stats", "config", "per_rank", "pd", "bounds",
    "ttft_l2_over_l1_hit", "ttft_l2_over_l1_hit_p90", "ttft_probe_pairs", "ttft_probe_valid_pairs",
    "ttft_probe_wall_s", "ttft_probe_error", "verify_restores", "verified_units", "verified_pages", "verify_failures",
    "integrity_dropped_pages", "loads_aborted",
}  # fmt: skip


def header(report: dict[str, Any]) -> str:
    """One line saying what ran, with the sizes in pages and GiB."""
    tpb = report.get("tokens_per_block")
    scale = "" if tpb in (None, 512) else f"; 1 trace block = {tpb} replayed tokens"
    per_rank = report.get("host_bytes", 0) / max(1, len(report.get("per_rank") or [1]))
    return (
        f"replay: {report.get('trace')} ({report.get('requests')} requests, {report.get('trace_tokens', 0):,} "
        f"trace tokens{scale}); model {report.get('model')}, policy {report.get('policy')}, "
        f"{report.get('write_policy')}, CP {report.get('cp_size')}; L1 {report.get('l1_capacity_pages')} pages, "
        f"L2 {report.get('l2_capacity_pages')} pages ({per_rank / GIB:.3f} GiB per rank)"
    )


def print_table(report: dict[str, Any]) -> None:
    """The report for people: a header line, then sections with units."""
    tpb = report.get("tokens_per_block")
    unit = "trace tokens" if tpb in (None, 512) else "replayed tokens"
    prompt = report.get("prompt_tokens", 0) or 1

    def tokens(key: str) -> str:
        n = report.get(key, 0)
        return f"{n:,} ({100 * n / prompt:.1f}%)"

    sections: list[tuple[str, list[tuple[str, str]]]] = [
        (f"tokens ({unit})", [
            ("prompt", f"{report.get('prompt_tokens', 0):,}"),
            ("L1 hits", tokens("l1_hit_tokens")),
            ("L2 hits", tokens("l2_hit_tokens")),
            *([("L3 hits", tokens("l3_hit_tokens"))] if "l3_hit_tokens" in report else []),
            ("computed", tokens("miss_tokens")),
            ("hit rate", f"{report.get('hit_rate', 0.0):.4f}"),
        ]),
        ("copies", [
            ("D2H committed", f"{report.get('bytes_d2h', 0) / GIB:.3f} GiB"),
            ("H2D loaded", f"{report.get('bytes_h2d', 0) / GIB:.3f} GiB"),
            ("backups", f"{report.get('backups_committed', 0):,} committed, {report.get('backups_aborted', 0):,} aborted"),
            ("evictions", f"L1 {report.get('evictions_l1', 0):,} pages, L2 {report.get('evictions_l2', 0):,} pages"),
        ]),
        ("integrity: the harness's byte oracle", [
            ("checked", f"{report.get('integrity_checked_pages', 0):,} pages, {report.get('integrity_checked_units', 0):,} "
                        f"of {report.get('integrity_expected_units', 0):,} (page, part, layer) units"),
            ("mismatches", f"{report.get('integrity_mismatches', 0):,}"),
        ]),
        ("integrity: the library's restore checks", [
            ("mode", str(report.get("verify_restores", "off"))),
            ("checked", f"{report.get('verified_pages', 0):,} pages, {report.get('verified_units', 0):,} "
                        f"(page, part, layer) units"),
            ("failed", f"{report.get('verify_failures', 0):,} units; {report.get('loads_aborted', 0):,} loads aborted "
                       f"and recomputed, {report.get('integrity_dropped_pages', 0):,} L2 pages dropped"),
        ]),
        ("run", [
            ("wall", f"{report.get('wall_s', 0.0):.2f} s"),
            ("rejected requests", f"{report.get('rejected_requests', 0):,}"),
            ("L2 used", f"{report.get('l2_used_pages', 0):,} of {report.get('l2_capacity_pages', 0):,} pages"),
        ]),
    ]
    probe = _probe_rows(report)
    if probe:
        sections.append(("ttft probe (--ttft-probe)", probe))
    for name in ("pd", "bounds"):
        if isinstance(report.get(name), dict):
            sections.append((name, [(k, _fmt(v)) for k, v in report[name].items() if not isinstance(v, (list, dict))]))
    if report.get("per_rank"):
        sections.append(("per rank", [
            (f"rank {r['rank']}", f"L2 {r['l2_used_pages']}/{r['l2_capacity_pages']} pages, "
                                  f"{(r.get('host_bytes') or 0) / GIB:.3f} GiB, D2H {(r.get('bytes_d2h') or 0) / GIB:.3f} GiB")
            for r in report["per_rank"]
        ]))
    other = [(k, _fmt(v)) for k, v in sorted(report.items())
             if k not in _SHOWN and not isinstance(v, (list, dict))]  # fmt: skip
    if other:
        sections.append(("other", other))
    print(header(report))
    width = max(len(k) for _, rows in sections for k, _ in rows)
    for title, rows in sections:
        print(title)
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
    for m in report.get("mismatch_examples", []):
        print(f"mismatch: {m}")


def _probe_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The hf engine's probe: L2-hit over L1-hit TTFT, and layer times with and without copies."""
    rows = []
    if "ttft_probe_valid_pairs" in report:
        ratio, p90 = report.get("ttft_l2_over_l1_hit"), report.get("ttft_l2_over_l1_hit_p90")
        rows.append(("L2-hit / L1-hit TTFT", f"{_fmt(ratio)} median, p90 {_fmt(p90)}, over "
                     f"{report['ttft_probe_valid_pairs']} of {report.get('ttft_probe_pairs')} pairs "
                     f"(probe {_fmt(report.get('ttft_probe_wall_s'))} s)"))  # fmt: skip
    lt = report.get("layer_forward_ms")
    if isinstance(lt, dict) and "alone" in lt:
        rows.append(("layer time", f"p50 {_fmt(lt['alone']['p50'])} ms alone, {_fmt(lt['with_copies']['p50'])} ms "
                     f"with copies in flight ({_fmt(lt['ratio_p50'])}x; {lt['copied_bytes'] / GIB:.3f} GiB copied)"))
        hp = lt.get("hit_pairs")
        if isinstance(hp, dict):
            rows.append(("layer time in hits", f"p50 {_fmt(hp['l1_hit']['p50'])} ms L1 hits, {_fmt(hp['l2_hit']['p50'])} "
                         f"ms L2 hits ({_fmt(hp['ratio_p50'])}x; {hp['l2_load_bytes'] / GIB:.3f} GiB loaded)"))
    if report.get("ttft_probe_error"):
        rows.append(("error", str(report["ttft_probe_error"])))
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)
