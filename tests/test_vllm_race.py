"""The GPU run's tools, checked on CPU: the op build's bindings, the pack's include closure,
and the race's workload, timer and greedy-identity check (bench/engines/vllm_ops, bench/engines/vllm_pack.py,
bench/engines/vllm_race.py). The GPU run itself is bench/device/vllm_race.sh."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ENGINES = Path(__file__).resolve().parent.parent / "bench" / "engines"
sys.path.insert(0, str(ENGINES))

import vllm_pack  # noqa: E402
import vllm_race  # noqa: E402

build = vllm_pack.load_build_script()


def test_bindings_register_exactly_the_ops_the_build_checks():
    text = (ENGINES / "vllm_ops" / "bindings.cpp").read_text()
    defined: dict[str, list[str]] = {}
    for ns, body in re.findall(r"STABLE_TORCH_LIBRARY_FRAGMENT\((\w+), ops\) \{(.*?)\n\}", text, re.S):
        defined[ns] = sorted(re.findall(r'"(\w+)\(', body))
    assert defined == {ns: sorted(names) for ns, names in build.EXPECTED_OPS.items()}
    implemented = set(re.findall(r'ops\.impl\("(\w+)"', text))
    assert implemented == {n for names in build.EXPECTED_OPS.values() for n in names}


def test_include_closure_follows_quotes_and_search_paths_only():
    files = {
        "csrc/a.cu": '#include "b.h"\n#include <torch/x.h>\n#include "core/c.h"\n',
        "csrc/b.h": '#include "../csrc/d.h"\n',
        "csrc/core/c.h": '#include "b.h"\n',  # resolved under the search path, not beside c.h
        "csrc/d.h": "",
        "csrc/unused.h": "",
    }
    got = vllm_pack.include_closure(["csrc/a.cu"], files.get, ["csrc"])
    assert got == {"csrc/a.cu", "csrc/b.h", "csrc/core/c.h", "csrc/d.h"}


def test_race_workload_shares_each_document_across_passes():
    ps = vllm_race.prompts(docs=3, doc_len=32, suffix_len=4, vocab=1000)
    assert {k: len(v) for k, v in ps.items()} == {"pass1": 3, "pass2": 3, "batch": 3, "warmup": 2}
    for i in range(3):
        a, b, c = ps["pass1"][i], ps["pass2"][i], ps["batch"][i]
        assert a[:32] == b[:32] == c[:32] and len({tuple(a[32:]), tuple(b[32:]), tuple(c[32:])}) == 3
    # the warm-up shares no 16-token block with what is timed
    timed = {tuple(p[j : j + 16]) for k in ("pass1", "pass2", "batch") for p in ps[k] for j in range(0, len(p) - 15, 16)}
    assert not timed & {tuple(p[j : j + 16]) for p in ps["warmup"] for j in range(0, len(p) - 15, 16)}
    assert ps["pass1"][0][:32] != ps["pass1"][1][:32]
    assert vllm_race.prompts(3, 32, 4, 1000) == ps  # the same token ids for every configuration


def test_race_counters_leave_out_the_warm_up():
    now = {"prompt_tokens": 10, "prompt_tokens_by_source": {"local_compute": 7, "external_kv_transfer": 3}}
    before = {"prompt_tokens": 4, "prompt_tokens_by_source": {"local_compute": 4}}
    assert vllm_race.counters_since(now, before) == {
        "prompt_tokens": 6, "prompt_tokens_by_source": {"local_compute": 3, "external_kv_transfer": 3}}
    assert vllm_race.counters_since(now, {}) == now


def test_race_identity_names_the_outputs_that_differ():
    base = {"ok": True, "outputs": {"pass1": [[1], [2]], "pass2": [[3], [4]], "batch": [[5, 6]]}}
    other = {"ok": True, "outputs": {"pass1": [[1], [2]], "pass2": [[3], [9]], "batch": [[5, 6]]}}
    got = vllm_race.compare({"hicache": other, "offloading": base, "none": base, "broken": {"ok": False}})
    assert got["baseline"] == "none"
    assert got["hicache"] == {"identical": False, "differing": [("pass2", 1)]}
    assert got["offloading"]["identical"] and "broken" not in got


def test_race_timer_splits_roles_and_closes_a_step_at_its_last_call():
    class Connector:
        def get_num_new_matched_tokens(self):
            return 1

        def build_connector_meta(self):
            return 2

        def wait_for_save(self):
            return 3

        def build_connector_worker_meta(self):
            return 4

    timer = vllm_race.StepTimer()
    timer.wrap(Connector)
    c = Connector()
    for _ in range(3):
        assert (c.get_num_new_matched_tokens(), c.build_connector_meta()) == (1, 2)
        assert (c.wait_for_save(), c.build_connector_worker_meta()) == (3, 4)
    c.wait_for_save()  # an open worker step is not counted
    s = timer.summary()
    assert s["scheduler"]["steps"] == 3 and s["worker"]["steps"] == 3
    assert s["by_method"]["wait_for_save"]["calls"] == 4
    assert s["scheduler"]["mean_ms"] >= 0


class _Connector:
    """Test double: a connector with one scheduler-side and two worker-side methods."""

    def build_connector_meta(self):
        return 2

    def save_kv_layer(self):
        return 3

    def build_connector_worker_meta(self):
        return 4


def test_race_timer_wraps_one_instance_and_closes_steps_where_told():
    """The CPU comparison's use (bench/engines/vllm_compare.py): one connector instance per role, steps
    closed by the driver, wall and thread CPU time per role and method."""
    timer = vllm_race.StepTimer(explicit=True)
    c, other = _Connector(), _Connector()
    timer.wrap(c)
    for _ in range(2):
        assert (c.build_connector_meta(), c.save_kv_layer(), c.build_connector_worker_meta()) == (2, 3, 4)
        other.save_kv_layer()  # another instance: not timed
        timer.end_step()
    s = timer.summary()
    assert s["scheduler"]["steps"] == s["worker"]["steps"] == 2  # not closed at build_connector_meta
    assert s["by_method"]["save_kv_layer"]["calls"] == 2
    for role in ("scheduler", "worker"):
        assert 0 <= s[role]["cpu_mean_ms"] and 0 <= s[role]["total_ms"]
    assert 0 <= s["by_method"]["save_kv_layer"]["cpu_ms"]


def test_race_timer_summarises_the_steps_after_a_mark():
    """The race's batch pass alone (`connector_host_time_batch`): the steps closed and the
    calls made after `mark()`, methods not called since left out."""
    timer = vllm_race.StepTimer(explicit=True)
    c = _Connector()
    timer.wrap(c)
    for _ in range(3):
        c.save_kv_layer(), c.build_connector_meta(), c.build_connector_worker_meta()
        timer.end_step()
    mark = timer.mark()
    for _ in range(2):
        c.build_connector_meta(), c.build_connector_worker_meta()
        timer.end_step()
    s, whole = timer.summary(since=mark), timer.summary()
    assert s["scheduler"]["steps"] == s["worker"]["steps"] == 2 and whole["worker"]["steps"] == 5
    assert s["by_method"]["build_connector_meta"]["calls"] == 2 and whole["by_method"]["build_connector_meta"]["calls"] == 5
    assert "save_kv_layer" not in s["by_method"]
    assert 0 <= s["worker"]["cpu_mean_ms"] and s["worker"]["total_ms"] <= whole["worker"]["total_ms"]


def test_op_build_records_commit_machine_and_command_when_it_fails(tmp_path):
    out = tmp_path / "ops.json"
    argv = ["--csrc", str(tmp_path / "csrc"), "--site", str(tmp_path), "--build-dir", str(tmp_path / "b"),
            "--json", str(out)]
    assert build.main(argv) == 1
    report = json.loads(out.read_text())
    assert report["commit"] and report["machine"] and report["command"] == "python3 bench/engines/vllm_ops/build.py " + " ".join(argv)
    assert not report["ok"] and report["error"].startswith("FileNotFoundError: vLLM sources missing")


def test_race_identity_reports_the_largest_logprob_gap():
    def run(lp):
        return {"ok": True, "outputs": {"pass1": [[1]], "pass2": [[2]], "batch": []},
                "logprobs": {"pass1": [-1.0], "pass2": [lp]}}

    got = vllm_race.compare({"none": run(-2.0), "hicache": run(-2.25), "offloading": run(None)})
    assert got["hicache"]["max_abs_logprob_delta"] == 0.25 and got["hicache"]["identical"]
    assert got["offloading"]["max_abs_logprob_delta"] == 0.0  # pass 2 had no logprob: pass 1 only


def test_race_reports_the_restore_checks_of_the_connectors_that_ran():
    """The race's child finds the connectors whose worker side ran through the timer and sums
    their engines' restore-check counters (checked per tier, failed per tier and part); a
    connector without our worker side (vLLM's own) reports none."""
    from types import SimpleNamespace

    from hicache_cp.metrics import IntegrityStats

    class Connector:
        def __init__(self, integrity):
            self.worker_side = SimpleNamespace(engine=SimpleNamespace(integrity=integrity))

        def save_kv_layer(self):
            return 3

    timer = vllm_race.StepTimer()
    timer.wrap(Connector)
    stats = [IntegrityStats(), IntegrityStats()]
    stats[0].count_checked("l2", 40)
    stats[1].count_checked("l2", 2)
    stats[1].count_failed("l2", "target_kv", 1)
    connectors = [Connector(s) for s in stats]
    for c in connectors + connectors:
        c.save_kv_layer()
    assert len(timer.workers) == 2
    checks = vllm_race.restore_checks(list(timer.workers.values()))
    assert checks == {"checked_units": {"l2": 42}, "failed_units": {"l2/target_kv": 1}}
    assert vllm_race.restore_checks([object()]) is None
    row = vllm_race.table({"hicache": {"ok": True, "ttft_ms": {"pass1": {"p50": 1, "p90": 2}, "pass2": {"p50": 1, "p90": 2}},
                                       "batch": {"tokens_per_s": 1.0}, "restore_checks": checks}})  # fmt: skip
    assert "| restore checks: units checked / failed | 42 / 1 |" in row
