#!/usr/bin/env python3
"""Deliberate faults, one at a time, each followed by the tests that must catch it.

    python tools/mutate.py                 # every fault; prints the survivors, exit 1 if any
    python tools/mutate.py --only ops-     # faults whose name starts with a prefix
    python tools/mutate.py --list

For each fault the tree is copied to a temporary directory (without .git and
the virtual environment), one snippet of one file is replaced (the snippet
must occur exactly once: a fault that no longer applies is an error, so the
list stays true as the code moves), and the named tests run there with this
interpreter. A fault the tests do not catch is a *survivor*: either a hole in
the tests or an equivalent change (then say why in `equivalent`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SKIP = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "*.egg-info",
                               ".whl", ".devdata", ".sglang_src")


def IGNORE(directory: str, names: list[str]) -> set[str]:
    """What the tree copy leaves out: caches and environments, and bench/results (the
    benchmark scripts under bench/ stay: tests import them)."""
    skipped = set(_SKIP(directory, names))
    if Path(directory).resolve() == (ROOT / "bench").resolve():
        skipped.add("results")
    return skipped


@dataclass(frozen=True)
class Fault:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str  # the invariant or contract it breaks
    equivalent: str = ""  # when a survivor is expected: why the change is equivalent


FAULTS: list[Fault] = [
    # ---- landed means the bytes landed, visibility on commit (DOMAIN rule 3)
    Fault("ops-empty-submit-lands", "hicache_cp/ops.py", "if covered != self.local_pages:", "if False:",
          ("tests/test_ops_landed.py",), "a part that submitted nothing counts as landed"),
    Fault("ops-landed-while-pending", "hicache_cp/ops.py",
          "            if (t.part, t.layer) not in pending_layers:\n", "            if True:\n",
          ("tests/test_ops_landed.py",), "a layer counts landed while a copy of it is in flight"),
    Fault("ops-short-layer-recorded", "hicache_cp/ops.py", "        if len(tickets) != len(parts):\n",
          "        if False:\n", ("tests/test_ops_landed.py",),
          "a layer the engine answered with a ticket missing for one part is recorded as if whole"),
    Fault("ops-missing-layers-ignored", "hicache_cp/ops.py", "        if len(tickets) != len(jobs):",
          "        if False:", ("tests/test_ops_landed.py",),
          "layers left out of the engine's answer go unnoticed (the op would hang unsettled)"),
    Fault("commit-before-settled", "hicache_cp/cache/lifecycle.py", "        if ok and settled:\n            if not op.nodes:",
          "        if ok:\n            if not op.nodes:", ("tests/test_cache_scenarios.py",),
          "a backup commits before every rank saw every layer land"),
    Fault("commit-target-parts-only", "hicache_cp/cache/state.py", "        node.host_parts = self.all_parts\n",
          "        node.host_parts = frozenset(p for p in self.all_parts if p.model.value == \"target\")\n",
          ("tests/test_cache_scenarios.py",), "a commit without the draft parts (rule 1: all or nothing)"),
    Fault("match-returns-pending", "hicache_cp/cache/prefix.py",
          "elif not node.on_device and node.host_visible:", "elif not node.on_device and node.host_pages is not None:",
          ("tests/test_cache_scenarios.py", "tests/test_vllm_engine_l1.py"),
          "match_prefix returns a host copy that is still PENDING (host-only PENDING nodes exist with an "
          "engine-owned L1)"),
    Fault("abort-keeps-reservation", "hicache_cp/cache/lifecycle.py",
          "        s.free_host_pages(op.host_pages)  # the nodes' runs and the spare pages\n",
          "", ("tests/test_cache_scenarios.py",),
          "an aborted backup leaks its host reservation"),
    Fault("aborted-load-not-stale", "hicache_cp/cache/lifecycle.py", "                    node.stale_load = op\n",
          "                    pass\n", ("tests/test_cache_scenarios.py",),
          "an aborted load's L1 pages are served as valid KV"),
    Fault("hooks-copy-any-model", "hicache_cp/ops.py", "for p in layout.parts_of(m)) for m in Model}",
          "for p in layout.parts) for m in Model}", ("tests/test_cache_scenarios.py",),
          "a target hook copies draft layers the draft has not written"),
    # ---- eviction and free room (rule 5), locks
    Fault("evict-deficit-only", "hicache_cp/cache/eviction.py", "goal = min(target + need, alloc.capacity)",
          "goal = need", ("tests/test_cache_scenarios.py",), "eviction stops at the deficit, not the free-room target"),
    Fault("evict-most-recent", "hicache_cp/cache/eviction.py", "heap = [(s.policy.key_in(n, tier), n.id, n)",
          "heap = [(-s.policy.key_in(n, tier), n.id, n)", ("tests/test_policy.py", "tests/test_cache_scenarios.py"),
          "eviction takes the leaf the policy ranks most valuable first"),
    Fault("l1-free-not-poisoned", "hicache_cp/cache/state.py",
          "        if self.config.debug_checks and not self.device_pool.is_cuda:\n", "        if False:\n",
          ("tests/test_cache_scenarios.py", "tests/test_ops_landed.py"),
          "a freed L1 page keeps its KV, so a read after the free passes the byte checks"),
    Fault("l2-free-not-poisoned", "hicache_cp/cache/state.py", "            self.host_pool.poison(pages)\n", "            pass\n",
          ("tests/test_cache_scenarios.py",), "a freed L2 page keeps its KV, so a read after the free passes the byte checks"),
    Fault("evict-locked-nodes", "hicache_cp/radix.py", "free = node.lock_ref == 0 and node.load is None",
          "free = node.load is None", ("tests/test_cache_scenarios.py", "tests/test_radix.py"),
          "a locked node becomes evictable"),
    Fault("split-forgets-ops", "hicache_cp/radix.py", "                op.nodes.append(upper)  # type: ignore[attr-defined]\n",
          "                pass\n", ("tests/test_cache_stateful.py::test_seeded_stress",),
          "a node split under an in-flight op loses the op on one half"),
    Fault("radix-match-ignores-tail", "hicache_cp/radix.py", "    if np.array_equal(a, b):\n        return k // page_size",
          "    if np.array_equal(a[:page_size], b[:page_size]):\n        return k // page_size",
          ("tests/test_radix.py",), "a match compares only the first page of a node"),
    # ---- CP agreement (rule 7) and mapping
    Fault("agreement-max", "hicache_cp/cp/agreement.py", "op=self._dist.ReduceOp.MIN", "op=self._dist.ReduceOp.MAX",
          ("tests/test_cp_ranks.py",), "one rank's failure no longer wins"),
    Fault("agreement-no-count-check", "hicache_cp/cp/agreement.py", "if low != n or -neg_high != n:", "if False:",
          ("tests/test_cp_ranks.py::test_agreement_catches_ranks_with_different_op_counts",),
          "ranks whose op lists diverged mix two ops' votes"),
    Fault("cp-owner-off-by-one", "hicache_cp/cp/mapping.py", "(pages - 1) % cp_size)", "pages % cp_size)",
          ("tests/test_cp_mapping.py",), "page ownership ignores the dummy page"),
    # ---- allocator
    Fault("extents-no-double-free-check", "hostmem/extents.py", "self._free_map.find(_FREE, start, start + length) >= 0",
          "False", ("tests/test_extents.py",), "a double free corrupts the free extents"),
    Fault("lane-accepts-non-runs", "hicache_cp/allocator.py", "n == 1 or pages.tobytes() == self._ids[first : last + 1].tobytes()",
          "True", ("tests/test_lane_allocator.py",), "a page list shaped like a run is freed as one"),
    # ---- copy engine
    Fault("cpu-copy-misplaces-pages", "hicache_cp/io/cpu.py", "rows = dev[device_pages]\n",
          "rows = dev[device_pages[::-1]]\n", ("tests/test_io_engine.py",), "a backup writes pages to the wrong slots"),
    # ---- the cpu backend's restore checks (io/verify.py HostChecks)
    Fault("cpu-check-batch-never-hashes", "hicache_cp/io/verify.py",
          "todo = sorted(distinct - self._hashed)", "todo = []",
          ("tests/test_io_cpu_checks.py", "tests/test_restore_checks.py"),
          "a copy hashed in batches stores or compares whatever its op's table held"),
    Fault("cpu-check-run-view-off-by-one", "hicache_cp/io/verify.py",
          "self.device_pages if first is None else slice(first, first + n)",
          "self.device_pages if first is None else slice(first + 1, first + n + 1)", ("tests/test_io_cpu_checks.py",),
          "pages that are one run are hashed one page off"),
    Fault("cpu-check-skips-a-copy", "hicache_cp/io/verify.py", "del self.pending[:done]",
          "del self.pending[:done + 1]", ("tests/test_io_cpu_checks.py",),
          "a copy still in flight leaves its op's checks: it completes unchecked"),
    Fault("cpu-load-hashed-before-landed-writes", "hicache_cp/io/cpu.py",
          "        if self.landed is not None:\n            self.landed(direction, part, layer, device_pages, host_pages)\n"
          "        if checks is not None and direction is Direction.H2D:\n            checks.hash_landed(part, slot, dev)\n",
          "        if checks is not None and direction is Direction.H2D:\n            checks.hash_landed(part, slot, dev)\n"
          "        if self.landed is not None:\n            self.landed(direction, part, layer, device_pages, host_pages)\n",
          ("tests/test_restore_checks.py",), "a load hashed on its worker misses a write that raced it into its pages"),
    # ---- integrity oracle, exit codes
    Fault("checker-skips-draft", "hicache_harness/engines/synthetic.py",
          "return [(part, part.layer_ids) for part in self.layout.parts]",
          "return [(part, part.layer_ids) for part in self.layout.parts if part.part.model is Model.TARGET]",
          ("tests/test_replay.py",), "the replay's checker skips the draft parts"),
    Fault("integrity-failure-exits-0", "hicache_harness/replay/command.py",
          "return ExitCode.INTEGRITY if failures else ExitCode.OK", "return ExitCode.OK",
          ("tests/test_replay.py", "tests/test_pd_replay.py"), "an integrity failure exits 0"),
    Fault("pd-room-failure-ignored", "hicache_harness/replay/report.py", 'if report.get("pd_failed_rooms"):',
          'if False:', ("tests/test_pd_replay.py",), "replay --pd exits 0 when a room failed"),
    Fault("internal-error-as-bad-input", "hicache_harness/cli.py", "        return ExitCode.INTERNAL",
          "        return ExitCode.BAD_INPUT", ("tests/test_bad_inputs.py",), "a bug is reported as bad input"),
    # ---- L3 tier
    Fault("l3-frees-held-pages", "hicache_cp/cache/l3_writer.py", "        mask = self.held[pages] > 0\n",
          "        mask = self.held[pages] < 0\n", ("tests/test_l3_cache.py",),
          "L2 frees a page an L3 write-back is still reading"),
    Fault("l3-failed-fetch-commits", "hicache_cp/l3/ops.py",
          "        if self.error is not None or self.cancelled or self.state is PrefetchState.FAILING:",
          "        if self.cancelled or self.state is PrefetchState.FAILING:",
          ("tests/test_l3_cache.py", "tests/test_l3_faults.py"), "a prefetch whose read failed commits its pages"),
    # ---- the DMA issue worker (its driver is a double; the CUDA side runs on the device)
    Fault("issue-orphan-done-kept", "hicache_cp/io/issue.py", "        if self._orphans:\n", "        if False:\n",
          ("tests/test_io_issue.py",), "a ticket dropped before its layer was issued never gives `done` back"),
    Fault("issue-waiters-not-woken", "hicache_cp/io/issue.py", "                    if i + 1 < n:\n",
          "                    if False:\n", ("tests/test_io_issue.py",),
          "a forward waiting on a load's layer is told only when the whole load was issued"),
    Fault("issue-layers-after-a-failure-issued", "hicache_cp/io/issue.py",
          "                        job.fail(i, exc)\n                    break\n",
          "                        job.fail(i, exc)\n                    continue\n", ("tests/test_io_issue.py",),
          "layers issued after a failed one, perhaps on a stream that did not wait for compute"),
    Fault("issue-copy-stream-not-ordered", "hicache_cp/io/issue.py",
          "            drv.stream_wait_event(stream, job.order)\n", "            pass\n", ("tests/test_io_issue.py",),
          "a job's copies do not wait for the compute its caller followed"),
    # ---- planned descriptors (pure numpy)
    Fault("plans-chunk-crossing-missed", "hicache_cp/io/plans.py",
          "        crossing = (off // g.chunk != (off + size - 1) // g.chunk).any(axis=(1, 2))\n",
          "        crossing = np.zeros(off.shape[0], dtype=bool)\n", ("tests/test_io_plans.py",),
          "a DMA crosses a host registration chunk (cudaErrorInvalidValue on the H200)"),
    Fault("plans-group-rows-share-sizes", "hicache_cp/io/plans.py",
          "        size = runs.lengths * g.page_bytes  # (rows, parts, runs)\n",
          "        size = runs.lengths * g.page_bytes[:1]  # (rows, parts, runs)\n", ("tests/test_io_plans.py",),
          "a group's rows of another model copy with the first row's page sizes"),
    # ---- configuration
    Fault("env-below-toml", "hicache_cp/config.py", "        values.update(env_values)\n",
          "        values = {**env_values, **values}\n", ("tests/test_config_sources.py",),
          "the environment no longer beats the TOML file"),
    Fault("keys-parent-ignored", "hicache_cp/keys.py", "g += np.uint64(parent)", "g += np.uint64(0)",
          ("tests/test_radix.py",), "a prefix-hash chain does not continue from its parent"),
    # ---- PD: exact counts, nothing truncated, drain before reclaim (rule 9)
    Fault("pd-done-with-missing-layers", "hicache_cp/pd/sender.py",
          "                if n_got != len(owned):\n",
          "                if False:\n",
          ("tests/test_pd.py", "tests/test_pd_faults.py"), "finish says done while a part or layer was not sent"),
    Fault("pd-close-cancel-escapes", "hicache_cp/pd/engine.py",
          "        except CancelledError:  # close() cancelled the wait before it ran\n",
          "        except KeyError:\n", ("tests/test_pd.py",),
          "closing mid-wait kills the watcher thread with a traceback and hands callers an untyped error"),
    Fault("pd-position-sent-twice", "hicache_cp/pd/plan.py",
          "if sent is not None and n and sent[pos].any():",
          "if False:",
          ("tests/test_pd.py",), "a (part, layer, position) is sent twice"),
    Fault("pd-runs-ignore-decode-pages", "hicache_cp/pd/plan.py",
          " | (dst[1:] != dst[:-1] + 1)",
          "",
          ("tests/test_pd.py",), "a run is coalesced although its decode pages are not consecutive"),
    Fault("pd-release-while-in-flight", "hicache_cp/pd/room.py",
          "        if self.in_flight:\n            self.draining = True",
          "        if False:\n            self.draining = True",
          ("tests/test_pd_rooms.py", "tests/test_pd_faults.py"),
          "a room's pages are released while a write out of them may still land"),
    Fault("pd-expired-room-accepts", "hicache_cp/pd/room.py",
          "        if self.expired():\n",
          "        if False:\n",
          ("tests/test_pd_rooms.py",), "a room past its deadline still takes chunks"),
    Fault("pd-rank-vote-ignored", "hicache_cp/pd/sender.py",
          "if not agreed and room.state is RoomState.TRANSFERRING:",
          "if False:",
          ("tests/test_pd_cp.py",), "a room succeeds on one CP rank while another failed it"),
    Fault("pd-hash-drift-ignored", "hicache_cp/pd/sender.py",
          "if known.any() and (room.hashes[pos[known]] != plan.hashes[known]).any():",
          "if False:",
          ("tests/test_pd.py",), "a position re-sent with another prefix hash goes unnoticed"),
    # ---- host allocator: best fit, maximal extents
    Fault("extents-worst-fit", "hostmem/extents.py",
          "            i = bisect_left(lengths, n)\n",
          "            i = len(lengths) - 1\n",
          ("tests/test_extents.py",), "a contiguous reserve takes the largest extent, not the best fit"),
    Fault("extents-no-merge-right", "hostmem/extents.py",
          "            next_len = by_start.pop(end, None)\n",
          "            next_len = None\n",
          ("tests/test_extents.py",), "a freed run does not merge with the free extent after it"),
    # ---- DMA descriptors
    Fault("runs-ignore-host-side", "hicache_cp/io/runs.py",
          "    breaks = np.flatnonzero((dev[1:] != dev[:-1] + 1) | (host[1:] != host[:-1] + 1))\n",
          "    breaks = np.flatnonzero(dev[1:] != dev[:-1] + 1)\n",
          ("tests/test_io_engine.py",), "a descriptor spans host pages that are not consecutive"),
    Fault("runs-cross-registration", "hicache_cp/io/runs.py",
          "            piece = min(size, (off // chunk + 1) * chunk - off)\n",
          "            piece = size\n",
          ("tests/test_io_engine.py",), "a DMA crosses a registration chunk of the arena"),
    # ---- SGLang plug-in
    Fault("sglang-failed-load-served", "hicache_cp/integrations/sglang/radix_cache.py",
          "        if load is not None and load.state is LoadState.DONE:\n",
          "        if True:\n",
          ("tests/test_sglang_radix.py",), "a request whose load failed is served from the KV it never got"),
    Fault("sglang-freed-slots-not-waited", "hicache_cp/integrations/sglang/radix_cache.py",
          "        return any(start < hi and lo < end for start, end in ranges)",
          "        return False",
          ("tests/test_sglang_radix.py",), "SGLang reuses slots a copy is still reading or writing"),
    Fault("sglang-counts-every-probe", "hicache_cp/integrations/sglang/radix_cache.py",
          "match_prefix(tokens, count=False, checked_from=device_pages)",
          "match_prefix(tokens, checked_from=device_pages)",
          ("tests/test_sglang_metrics.py",), "a request SGLang matches each scheduling round is counted each time"),
    Fault("sglang-unwritten-backup-commits", "hicache_cp/integrations/sglang/radix_cache.py",
          "unwritten = [op for op in flow.backups if op.active and op.missing_layers()]",
          "unwritten = []",
          ("tests/test_sglang_radix.py",), "a backup of layers the forward never wrote stays to commit garbage"),
    # ---- vLLM connector
    Fault("vllm-counts-every-lookup", "hicache_cp/integrations/vllm/scheduler.py",
          "match_prefix(tokens, count=False, checked_from=local)", "match_prefix(tokens, checked_from=local)",
          ("tests/test_vllm_metrics.py",), "a request vLLM looks up again each step is counted each time"),
    Fault("vllm-full-hit-computes-nothing", "hicache_cp/integrations/vllm/scheduler.py",
          "end = min(m.device_len + m.host_len, (request.num_tokens - 1) // bs)",
          "end = m.device_len + m.host_len",
          ("tests/test_vllm_connector.py",), "a full hit leaves vLLM no token to compute"),
    Fault("vllm-one-worker-decides", "hicache_cp/integrations/vllm/scheduler.py",
          "                if count < self.world_size:\n",
          "                if False:\n",
          ("tests/test_vllm_connector.py",), "a copy commits on one worker's verdict under TP"),
    Fault("vllm-failed-load-not-recomputed", "hicache_cp/integrations/vllm/scheduler.py",
          "                st.covered = min(st.covered, load.first_position)  # vLLM recomputes from there\n",
          "                pass\n",
          ("tests/test_vllm_connector.py",), "pages recomputed after a failed load get no host copy"),
    Fault("vllm-extra-keys-ignored", "hicache_cp/integrations/vllm/scheduler.py",
          "    return keys is None\n",
          "    return True\n",
          ("tests/test_vllm_connector.py",), "a salted or LoRA request shares KV by its tokens alone"),
    Fault("vllm-finished-request-freed-under-a-save", "hicache_cp/integrations/vllm/scheduler.py",
          "        return delay, None\n",
          "        return False, None\n",
          ("tests/test_vllm_connector.py",), "vLLM reuses a finished request's blocks while a save still reads them"),
    Fault("vllm-unplaced-match-kept", "hicache_cp/integrations/vllm/scheduler.py",
          "        for st in [st for st in self._matched.values() if st.load is None]:\n",
          "        for st in []:\n",
          ("tests/test_vllm_connector.py",), "a lookup vLLM did not place keeps its L2 path locked (never evicted)"),
    Fault("vllm-token-copy-never-grows", "hicache_cp/integrations/vllm/scheduler.py",
          "        if ids is None or len(ids) < n:\n",
          "        if ids is None:\n",
          ("tests/test_vllm_worker_cost.py", "tests/test_vllm_connector.py"),
          "a decode's new page is saved under the tokens of an older, shorter copy"),
    # ---- prefix match (a host copy missing a part)
    Fault("match-parts-unchecked", "hicache_cp/cache/prefix.py",
          "        if node.host_parts != s.all_parts:\n",
          "        if False:\n",
          ("tests/test_cache_scenarios.py",), "a host copy missing a part is served (rule 1: all or nothing)"),
    # ---- L3 hit accounting
    Fault("l3-hit-counted-twice", "hicache_cp/cache/l3_hits.py",
          "        self.fresh[hit] = False\n",
          "",
          ("tests/test_l3_cache.py",), "an L3-fetched page counts as an L3 hit at every match"),
    Fault("l3-aborted-load-hits-kept", "hicache_cp/cache/l3_hits.py",
          "            if load.state is LoadState.ABORTED:\n",
          "            if False:\n",
          ("tests/test_l3_cache.py",), "the L3 hits of an aborted load stay counted"),
    # ---- configuration: contradictions and typos are refused
    Fault("config-exclusive-without-write-back", "hicache_cp/config.py",
          "        if self.l2_exclusive and self.write_policy is not WritePolicy.WRITE_BACK:\n",
          "        if False:\n",
          ("tests/test_config.py", "tests/test_config_sources.py", "tests/test_policy_exclusive.py"),
          "an exclusive L2 under write-through (pages would live in neither tier)"),
    Fault("config-typo-env-accepted", "hicache_cp/config.py",
          "        elif key not in NON_FIELD_ENV:\n",
          "        elif False:\n",
          ("tests/test_config.py", "tests/test_config_sources.py", "tests/test_bad_inputs.py"),
          "a mistyped HICACHE_ variable is silently ignored"),
    Fault("config-unknown-field-accepted", "hicache_cp/config.py",
          '        if unknown:\n            raise ConfigError(f"unknown config field(s)',
          '        if False:\n            raise ConfigError(f"unknown config field(s)',
          ("tests/test_config.py", "tests/test_config_sources.py", "tests/test_bad_inputs.py"),
          "an unknown field of a config file is silently ignored"),
    # ---- L3: objects of another layout or size are never read as ours
    Fault("l3-fingerprint-ignores-cp", "hicache_cp/l3/keys.py",
          '        "cp_size": cp_size,\n',
          "",
          ("tests/test_l3_keys.py", "tests/test_l3_cache.py"),
          "a CP 2 rank reads objects a CP 1 cache wrote (another sharding)"),
    Fault("l3-fingerprint-ignores-dtype", "hicache_cp/l3/keys.py",
          '        "kv_dtype": config.kv_dtype,\n',
          "",
          ("tests/test_l3_keys.py", "tests/test_l3_cache.py"), "a bf16 cache reads fp8 objects"),
    Fault("l3-short-read-accepted", "hicache_cp/l3/store.py",
          "            elif n != want:\n",
          "            elif False:\n",
          ("tests/test_l3_faults.py", "tests/test_l3_cache.py", "tests/test_l3_sglang.py"),
          "an object that filled part of its pages counts as read"),
    # ---- PD registration
    Fault("pd-registration-ignores-page-bytes", "hicache_cp/pd/registration.py",
          '        cmp(f"{part.value} page_bytes", a.page_bytes, b.page_bytes)\n',
          "",
          ("tests/test_pd.py", "tests/test_pd_control.py"), "prefill and decode pages of different sizes are paired"),
    # ---- the real-model engine's oracles
    Fault("oracle-min-error", "hicache_harness/engines/hf_oracle.py",
          "    err = float((restored.float() - reference.float()).abs().max())",
          "    err = float((restored.float() - reference.float()).abs().min())",
          ("tests/test_hf_oracles.py",), "restored logits are held to the tolerance by their closest entry"),
    Fault("digest-book-accepts-any", "hicache_harness/engines/hf_oracle.py",
          "                ok[i] = (known == digests[i]).any(axis=0)",
          "                ok[i] = True",
          ("tests/test_hf_oracles.py", "tests/test_integrity.py"), "a restored unit passes whatever its bytes"),
    # ---- per-layer landing of an op
    Fault("load-waits-first-part-only", "hicache_cp/ops.py",
          "            if layer in owned:\n                self.wait_part(part, layer)\n",
          "            if layer in owned:\n                self.wait_part(part, layer)\n                break\n",
          ("tests/test_ops_landed.py", "tests/test_cache_scenarios.py", "tests/test_engine_hf_scenarios.py"),
          "the forward reads a layer whose other parts (the indexer keys, the draft) are still loading"),
    Fault("reap-failed-ticket-lands", "hicache_cp/ops.py",
          "            if state is TicketState.FAILED:\n",
          "            if False:\n",
          ("tests/test_ops_landed.py", "tests/test_cache_scenarios.py"), "a failed copy counts as landed"),
    # ---- PD control channel: decode-initiated aborts, authentication
    Fault("control-stale-reply-accepted", "hicache_cp/pd/control.py",
          '            elif reply.get("seq") == self._seq:\n',
          "            elif True:\n",
          ("tests/test_pd_control.py", "tests/test_pd_faults.py"),
          "the answer to an earlier, timed-out request is taken as this one's"),
    Fault("control-events-dropped-during-request", "hicache_cp/pd/control.py",
          '            if "event" in reply:\n                self._events.append(reply)\n            elif',
          '            if "event" in reply:\n                pass\n            elif',
          ("tests/test_pd_control.py", "tests/test_pd_faults.py"),
          "a decode abort that arrives while a request waits is lost"),
    Fault("sender-decode-abort-ignored", "hicache_cp/pd/sender.py",
          '            self._abort(room, f"decode aborted: {ev.get(\'reason\')}")\n',
          "            pass\n",
          ("tests/test_pd_control.py", "tests/test_pd_faults.py"),
          "the prefill side keeps sending into a room the decode side aborted"),
    Fault("authkey-short-accepted", "hicache_cp/pd/control.py",
          "len(authkey) < MIN_AUTHKEY_BYTES:",
          "False:",
          ("tests/test_pd_control.py", "tests/test_bad_inputs.py"), "a guessable control key is accepted"),
    Fault("feeder-error-dropped", "hicache_cp/pd/feeder.py",
          "                    self._errors.append(exc)\n",
          "                    pass\n",
          ("tests/test_pd.py", "tests/test_pd_faults.py", "tests/test_pd_control.py"),
          "a per-layer submission that failed off the caller's thread is forgotten; the room says done"),
    # ---- host arena and pools
    Fault("arena-view-out-of-bounds", "hostmem/arena.py",
          "        if offset < 0 or length < 0 or offset + length > self._nbytes:\n",
          "        if False:\n",
          ("tests/test_arena.py",), "a view reaches past the arena"),
    Fault("arena-view-before-ready", "hostmem/arena.py",
          "        self.wait_ready(offset + length)\n        return length\n",
          "        return length\n",
          ("tests/test_arena.py",), "a view of bytes still being prepared is handed out"),
    Fault("pool-free-out-of-range", "hicache_cp/allocator.py",
          "            if pairs[0][0] < 1 or last_start + last_len - 1 > self.capacity:\n",
          "            if False:\n",
          ("tests/test_lane_allocator.py", "tests/test_bad_inputs.py"),
          "the dummy page 0 or a page past the pool is freed"),
    # ---- lifecycle guards, trace input
    Fault("recomputed-after-release-accepted", "hicache_cp/cache/lifecycle.py",
          '                if node.lock_ref == 0:\n                    raise ValueError(f"{node}: recomputed()',
          '                if False:\n                    raise ValueError(f"{node}: recomputed()',
          ("tests/test_cache_scenarios.py",), "a stale node is declared valid after its request let go of it"),
    Fault("trace-block-count-unchecked", "hicache_harness/trace.py",
          "    if len(ids) != want:\n",
          "    if False:\n",
          ("tests/test_trace.py", "tests/test_bad_inputs.py"),
          "a trace line whose blocks do not cover its input is replayed"),
    # ---- L3 operations: quarantine after a failed call, deadlines, surplus pages
    Fault("l3-quarantine-skipped", "hicache_cp/l3/ops.py",
          "    if isinstance(exc, L3Error) and exc.io_may_be_in_flight:\n",
          "    if False:\n",
          ("tests/test_l3_faults.py", "tests/test_l3_cache.py", "tests/test_l3_stateful.py"),
          "pages a failed Mooncake call may still write are reused at once"),
    Fault("l3-prefetch-deadline-ignored", "hicache_cp/l3/ops.py",
          "if not done and self.error is None and not self.cancelled and now > self.deadline:",
          "if False:",
          ("tests/test_l3_cache.py", "tests/test_l3_stateful.py"), "a prefetch that never returns holds its request"),
    Fault("l3-write-quarantine-skipped", "hicache_cp/l3/ops.py",
          "        released = self.quarantined_until is None or time.monotonic() >= self.quarantined_until\n",
          "        released = True\n",
          ("tests/test_l3_load.py", "tests/test_l3_faults.py", "tests/test_l3_stateful.py"),
          "pages a failed put may still read are released at once"),
    Fault("l3-surplus-leaked", "hicache_cp/cache/l3_prefetch.py",
          "            s.free_host_pages(op.host_pages[~attached])\n",
          "            pass\n",
          ("tests/test_l3_cache.py", "tests/test_l3_stateful.py"),
          "fetched pages the tree did not take are never freed"),
    # ---- vLLM worker: per-layer waits, load errors, saves without hooks
    Fault("vllm-indexer-waited-late", "hicache_cp/integrations/vllm/worker.py",
          "        if hook.next_state is not None:\n",
          "        if False:\n",
          ("tests/test_vllm_connector.py",), "layer l+1's indexer reads its keys before they are loaded"),
    Fault("vllm-load-errors-not-reported", "hicache_cp/integrations/vllm/worker.py",
          "                self._load_errors.update(int(b) for b in job.device_pages)\n",
          "                pass\n",
          ("tests/test_vllm_connector.py",), "vLLM is not told which blocks a failed load left invalid"),
    Fault("vllm-last-group-never-saved", "hicache_cp/integrations/vllm/worker.py",
          "                for model in (Model.TARGET, Model.DRAFT):\n                    self._submit_due(saves, model)\n",
          "                pass\n",
          ("tests/test_vllm_worker_cost.py",),
          "the last group of hooked layers goes out a layer at a time, reported as layers no hook saw"),
    Fault("vllm-hookless-layers-never-saved", "hicache_cp/integrations/vllm/worker.py",
          "                self._submit_missing(saves)\n",
          "                pass\n",
          ("tests/test_vllm_connector.py",), "layers whose save hook never fired are never copied"),
    Fault("vllm-full-graph-loads-unwaited", "hicache_cp/integrations/vllm/connector.py",
          "    if forward_context is None or forward_context.attn_metadata is None:\n        return False\n",
          "",
          ("tests/test_vllm_connector.py",), "a full CUDA-graph replay reads layers whose load has not landed"),
    Fault("vllm-preempted-saves-unwaited", "hicache_cp/integrations/vllm/worker.py",
          "        if not meta.preempted or not self._saves:\n",
          "        if True:\n",
          ("tests/test_vllm_connector.py",), "a preempted request's freed blocks are rewritten under its save"),
    Fault("vllm-load-errors-a-step-late", "hicache_cp/integrations/vllm/worker.py",
          "        self._finish_loads()\n        errors, self._load_errors",
          "        errors, self._load_errors",
          ("tests/test_vllm_connector.py",), "a failed load is reported after vLLM used its blocks (defer-finalize)"),
    # ---- SGLang per-layer hooks
    Fault("sglang-indexer-waited-late", "hicache_cp/integrations/sglang/layer_hooks.py",
          "                    self._wait(Part.TARGET_STATE, layer + 1)\n",
          "                    pass\n",
          ("tests/test_sglang_radix.py",), "layer l+1's indexer reads its keys before they are loaded"),
    Fault("sglang-backup-of-unwritten-layer", "hicache_cp/integrations/sglang/layer_hooks.py",
          "            upto = min(layer, self._layers[model])\n",
          "            upto = min(layer + 1, self._layers[model])\n",
          ("tests/test_sglang_radix.py",), "a layer is copied to L2 when its attention starts, before it is written"),
    Fault("sglang-last-group-never-backed-up", "hicache_cp/integrations/sglang/layer_hooks.py",
          "        for model in Model:\n            self._submit(fwd, model, self._layers[model])\n",
          "        pass\n",
          ("tests/test_sglang_radix.py",), "the layers of a forward's last group never reach L2: no backup commits"),
    Fault("sglang-draft-not-waited", "hicache_cp/integrations/sglang/layer_hooks.py",
          "                        for op in loads:\n                            op.wait_layer(d, Model.DRAFT)\n",
          "                        pass\n",
          ("tests/test_sglang_radix.py",), "the MTP draft reads its layers before they are loaded"),
    Fault("sglang-load-checks-unpinned", "hicache_cp/integrations/sglang/layer_hooks.py",
          "        if fwd.loads:\n            self.cache.loads_read(fwd.loads)\n",
          "        pass\n",
          ("tests/test_sglang_blockers.py",),
          "a load's restore checks follow whatever SGLang queued after its forward (the next one)"),
    Fault("sglang-load-checks-pinned-unfenced", "hicache_cp/integrations/sglang/layer_hooks.py",
          "bool(fwd.backups or fwd.loads)", "bool(fwd.backups)",
          ("tests/test_sglang_blockers.py",),
          "a whole hit's checks are pinned on the schedule stream, behind SGLang's next forward"),
    # ---- the real-model engine's scheduler
    Fault("hf-shared-loads-not-waited", "hicache_harness/engines/scheduler.py",
          "            for op in [*seq.m.waits, *([seq.load] if seq.load is not None else [])]:\n",
          "            for op in [*([seq.load] if seq.load is not None else [])]:\n",
          ("tests/test_engine_hf_scenarios.py", "tests/test_engine_hf.py"),
          "a request whose prefix another request is still loading reads it unwaited"),
    Fault("hf-aborted-load-served", "hicache_harness/engines/scheduler.py",
          "            redo = seq.load is not None and seq.load.state is LoadState.ABORTED and seq.redo_load is None\n",
          "            redo = False\n",
          ("tests/test_engine_hf_scenarios.py", "tests/test_engine_hf.py"),
          "a request whose load aborted is answered from the KV it never got"),
    # ---- PD transfer engine adapter, reuse_lru, the metrics export, layout validation
    Fault("pd-in-flight-cap-ignored", "hicache_cp/pd/engine.py",
          "                if not q or sum(eb.transfers for eb in q) + n <= self.max_in_flight:\n",
          "                if True:\n",
          ("tests/test_pd.py",), "more transfers in flight to one peer than the engine's cap"),
    Fault("pd-register-conflict-accepted", "hicache_cp/pd/engine.py",
          "        if ptr in self._registered:\n            raise ValueError",
          "        if False:\n            raise ValueError",
          ("tests/test_pd.py", "tests/test_pd_faults.py"), "a buffer registered again with another size is accepted"),
    Fault("reuse-lru-protects-nothing", "hicache_cp/policy/reuse_lru.py",
          "        return node.hit_count > 0 or node.reuse_hint > 0\n",
          "        return False\n",
          ("tests/test_policy.py",), "reuse_lru degenerates to LRU: content seen twice is not protected"),
    Fault("reuse-lru-l1-not-lru", "hicache_cp/policy/reuse_lru.py",
          '        return float(node.last_access) if tier == "l1" else self.key(node)\n',
          "        return self.key(node)\n",
          ("tests/test_policy.py",), "L1 order under reuse_lru is not plain LRU"),
    Fault("prometheus-l2-hits-as-l1", "hicache_cp/prometheus.py",
          '("l2",): stats["l2_hit_tokens"]',
          '("l2",): stats["l1_hit_tokens"]',
          ("tests/test_prometheus.py",), "the exported L2 hit counter shows L1 hits"),
    Fault("layout-duplicate-layers-accepted", "hicache_cp/layout.py",
          "        if len(set(self.layer_ids)) != len(self.layer_ids):\n",
          "        if False:\n",
          ("tests/test_layout.py", "tests/test_config.py"), "a part with one layer listed twice gets two slots for it"),
    Fault("pd-sender-holds-no-memory", "hicache_cp/pd/sender.py",
          "        self._held = [_buffers_of(pool) for pool in (device_pool, host_pool) if pool is not None]\n",
          "        self._held = []\n",
          ("tests/test_pd.py",), "a host pool closed before its sender unmaps memory the transfer engine may read"),
    Fault("interrupt-dropped-in-finalizer", "hicache_harness/lifetime.py",
          "        if not isinstance(exc, Interrupted):\n",
          "        if True:\n",
          ("tests/test_processes.py::test_an_interrupt_python_drops_inside_a_finalizer_is_delivered_again",),
          "a Ctrl-C whose exception Python dropped inside a finalizer is lost; the run goes on"),
    # ---- round 4 (issue 48): PD drain before reclaim, "abort, never done", lanes, the control channel
    Fault("pd-abort-told-before-drained", "hicache_cp/pd/sender.py",
          "        if self.rooms.abort(room, reason):\n",
          "        if self.rooms.abort(room, reason) or True:\n",
          ("tests/test_pd_round4.py",), "decode frees a room's pages while a batch of it still writes into them"),
    Fault("pd-aborted-room-gets-queued-layers", "hicache_cp/pd/sender.py",
          "            if room.state is not RoomState.TRANSFERRING:\n                return  # aborted meanwhile",
          "            if False:\n                return  # aborted meanwhile",
          ("tests/test_pd_round4.py",), "per-layer jobs queued before an abort are submitted after it"),
    Fault("pd-refused-send-not-raised", "hicache_cp/pd/sender.py",
          "            if room.deferred_failure:\n                self._abort(room, room.deferred_failure)",
          "            if False:\n                self._abort(room, room.deferred_failure)",
          ("tests/test_pd_round4.py",), "a synchronous send the engine refused returns as if sent"),
    Fault("pd-refused-submission-forgotten", "hicache_cp/pd/sender.py",
          "                room.deferred_failure = str(exc)\n",
          "                pass\n",
          ("tests/test_pd_round4.py",), "a refused submission is forgotten: the room says done without its bytes"),
    Fault("pd-partial-submission-untracked", "hicache_cp/pd/sender.py",
          "                    room.in_flight.append(exc.batch)\n",
          "                    pass\n",
          ("tests/test_pd_round4.py",),
          "engine batches that went out before a refused one are not drained before the pages are reused"),
    Fault("pd-batch-done-when-any-part-is", "hicache_cp/pd/engine.py",
          "        return all(p.status is not None for p in self.parts)",
          "        return any(p.status is not None for p in self.parts)",
          ("tests/test_pd_round4.py",), "a room split into engine batches is released while one is in flight"),
    Fault("pd-other-lane-page-sent", "hicache_cp/pd/plan.py",
          "        if (owners != rank).any():\n",
          "        if False:\n",
          ("tests/test_pd_round4.py",), "a CP rank sends a page of another rank's lane (another rank's memory)"),
    Fault("control-handshake-inline", "hicache_cp/pd/control.py",
          "            threading.Thread(target=self._authenticate, args=(key, h), name=\"pd-control-handshake\",\n"
          "                             daemon=True).start()\n",
          "            self._authenticate(key, h)\n",
          ("tests/test_pd_control.py",), "one idle connection holds every later client at the challenge"),
    Fault("control-handshake-no-deadline", "hicache_cp/pd/control.py",
          "        self._timer.start()\n",
          "        pass\n",
          ("tests/test_pd_control.py",), "a silent connection keeps its challenge (and a thread) forever"),
    Fault("control-listen-short-key", "hicache_cp/pd/control.py",
          "        self._authkey = check_authkey(authkey)\n",
          "        self._authkey = authkey\n",
          ("tests/test_pd_control.py",), "the decode side listens with a guessable key"),
    # ---- round 4: the copy engine's deferred tickets (the GPU-only faults live in tests/test_io_round4.py)
    Fault("deferred-wait-before-issue", "hicache_cp/io/dma.py",
          "        job.wait_issued(i)\n        self._error = self._error or job.error_of(i)\n",
          "        self._error = self._error or job.error_of(i)\n",
          ("tests/test_io_round4.py",), "wait() on a layer not issued yet syncs on an unrecorded event and returns"),
    # ---- round 4: backups on failing or aborted loads, loads refused midway
    Fault("cache-commit-on-failing-load", "hicache_cp/cache/lifecycle.py",
          "            if any(load.active for load in op.after):\n",
          "            if False:\n",
          ("tests/test_cache_round4.py",), "a backup commits while the load its pages were computed on is failing"),
    Fault("cache-backup-on-aborted-load-commits", "hicache_cp/cache/lifecycle.py",
          "        if ok and any(load.state is LoadState.ABORTED for load in op.after):\n",
          "        if False:\n",
          ("tests/test_cache_round4.py",), "pages computed on an aborted load keep their host copy"),
    Fault("cache-insert-on-stale-prefix-fresh", "hicache_cp/cache/prefix.py",
          "        if below is not None:  # computed on invalid KV",
          "        if False:  # computed on invalid KV",
          ("tests/test_cache_round4.py",), "pages inserted on a prefix whose load aborted become a hit once it is recomputed"),
    Fault("engine-l1-refused-load-not-waited", "hicache_cp/cache/engine_l1.py",
          "            for t in [*op.inflight, *exc.submitted]:\n",
          "            for t in op.inflight:\n",
          ("tests/test_cache_round4.py",), "load_into raises while copies it started still write the engine's pages"),
    Fault("checked-from-loads-unchecked-pages", "hicache_cp/cache/engine_l1.py",
          "        if first_position < match.checked_from:\n",
          "        if False:\n",
          ("tests/test_vllm_engine_l1.py",), "load_into reads host copies whose identity the match did not check"),
    Fault("checked-from-ignored", "hicache_cp/cache/prefix.py",
          "            found = self._first_stale(pages, host_nodes, checked_from)\n",
          "            found = self._first_stale(pages, host_nodes, 0)\n",
          ("tests/test_vllm_engine_l1.py",), "an engine's own prefix is identity-checked at every lookup"),
    # ---- round 4: CP agreement on a real machine's numbers
    Fault("agreement-min-int-float", "hicache_cp/cp/agreement.py",
          "        return int(self._all_min(np.array([value], dtype=np.int64))[0])",
          "        return int(self._all_min(np.array([value], dtype=np.float32))[0])",
          ("tests/test_cp_round4.py",), "a host budget above 2**24 bytes is agreed inexactly"),
    Fault("auto-budget-not-agreed", "hicache_cp/cache/build.py",
          "    budget = agreement.min_int(memory.pool_bytes // max(1, local_ranks))\n",
          "    budget = memory.pool_bytes // max(1, local_ranks)\n",
          ("tests/test_cp_round4.py",), "CP ranks of one op size L2 from their own memory reading"),
    # ---- round 4: L3 visibility and hit marks
    Fault("l3-prefetch-commits-unsettled", "hicache_cp/cache/l3_prefetch.py",
          "        if vote.ok and vote.settled:\n            self._commit(op)",
          "        if vote.ok:\n            self._commit(op)",
          ("tests/test_l3_round4.py",), "a prefetch is visible before its read returned on every rank"),
    Fault("l3-evicted-page-keeps-mark", "hicache_cp/cache/tier3.py",
          "        self.hits.forget(pages)\n",
          "",
          ("tests/test_l3_round4.py",), "an L2 page reused after eviction still counts as landed by L3"),
    # ---- round 4: signals, exit codes, settings
    Fault("interrupt-raised-inside-an-import", "hicache_harness/lifetime.py",
          "        if _importing(frame):",
          "        if False:",
          ("tests/test_signals.py::test_a_signal_during_an_import_is_raised_after_the_import",),
          "a signal raised inside a C++ module's init is swallowed (the run exits 0) or aborts"),
    Fault("swallowed-interrupt-exits-0", "hicache_harness/cli.py",
          "            lifetime.raise_if_interrupted()  # a signal whose",
          "            pass  # a signal whose",
          ("tests/test_signals.py::test_a_swallowed_interrupt_still_exits_128_plus_signal",),
          "a signal whose exception some code swallowed ends the run with 0"),
    Fault("output-io-error-is-a-bug", "hicache_harness/outputs.py",
          "    except OSError as exc:  # a full disk",
          "    except KeyError as exc:  # a full disk",
          ("tests/test_bad_inputs_round4.py",), "a full disk under --json exits 3 (a bug) instead of 2"),
    Fault("free-room-above-capacity-accepted", "hicache_cp/config.py",
          "        if target >= capacity:\n",
          "        if False:\n",
          ("tests/test_bad_inputs_round4.py",), "a free-room target at or above its tier's capacity is accepted"),
    Fault("pd-settings-without-pd-accepted", "hicache_harness/replay/setup.py",
          "    if not args.pd:\n        for name in",
          "    if False:\n        for name in",
          ("tests/test_bad_inputs_round4.py",), "pd_timeout_s from a TOML file is ignored without a word"),
    Fault("sglang-unhonoured-keys-accepted", "hicache_cp/integrations/sglang/settings.py",
          "    if unhonoured:\n",
          "    if False:\n",
          ("tests/test_plugin_settings.py",), "SGLang takes keys it cannot honour and ignores them"),
    Fault("vllm-budget-nan-accepted", "hicache_cp/integrations/vllm/settings.py",
          "not math.isfinite(value) or ",
          "",
          ("tests/test_plugin_settings.py",), "host_budget_gib = nan escapes as a ValueError"),
    Fault("env-unknown-always-refused", "hicache_cp/config.py",
          "            if strict:\n",
          "            if True:\n",
          ("tests/test_env_prefix.py",), "another program's HICACHE_ variable stops every command"),
]


def run_fault(fault: Fault, python: str, timeout_s: float) -> tuple[bool, float, str]:
    """Apply `fault` to a copy of the tree and run its tests: (caught, seconds, last output line)."""
    with tempfile.TemporaryDirectory(prefix="hicache-mutant-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=IGNORE)
        shared = ROOT.parent / "shared"
        if shared.exists():
            os.symlink(shared, Path(tmp) / "shared")
        target = tree / fault.file
        text = target.read_text()
        count = text.count(fault.old)
        if count != 1:
            raise SystemExit(f"fault {fault.name}: the snippet occurs {count} times in {fault.file}; update the list")
        target.write_text(text.replace(fault.old, fault.new))
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *fault.tests]
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
            caught = out.returncode != 0
            tail = (out.stdout.strip().splitlines() or [""])[-1]
        except subprocess.TimeoutExpired:
            caught, tail = True, f"timed out after {timeout_s:.0f} s (counted as caught: the tests hung)"
        return caught, time.perf_counter() - t0, tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the faults whose name starts with this")
    ap.add_argument("--list", action="store_true", help="list the faults and exit")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per fault")
    args = ap.parse_args()
    faults = [f for f in FAULTS if f.name.startswith(args.only)]
    if args.list:
        for f in faults:
            print(f"{f.name:<32} {f.file}: {f.why}")
        return 0
    survivors = []
    for f in faults:
        caught, seconds, tail = run_fault(f, sys.executable, args.timeout)
        print(f"{'caught  ' if caught else 'SURVIVED'} {f.name:<32} {seconds:6.1f} s  {tail}", flush=True)
        if not caught:
            survivors.append(f)
    print(f"\n{len(faults) - len(survivors)} of {len(faults)} faults caught")
    for f in survivors:
        note = f" (equivalent: {f.equivalent})" if f.equivalent else ""
        print(f"survivor: {f.name}: {f.why}{note}")
    return 1 if any(not f.equivalent for f in survivors) else 0


if __name__ == "__main__":
    sys.exit(main())
