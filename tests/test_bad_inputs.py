"""Every bad input ends in exit code 2 with one line naming it, before any
work starts, and leaves no file behind (issue: hardening).

Each case runs the real CLI in-process from an empty working directory with
`--json`/`--plot` pointed into it where the command has them; afterwards the
directory holds only the inputs the case wrote itself.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hicache_harness.cli import main

Setup = Callable[[Path], list[str]]


def _file(name: str, text: str) -> Setup:
    def make(d: Path) -> list[str]:
        (d / name).write_text(text)
        return [str(d / name)]

    return make


def _dir(name: str) -> Setup:
    def make(d: Path) -> list[str]:
        (d / name).mkdir()
        return [str(d / name)]

    return make


GOOD_LINE = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'

# (id, argv before the setup's paths, setup or None, argv after, expected message fragment)
CASES: list[tuple[str, list[str], Setup | None, list[str], str]] = [
    ("l2-gib-inf", ["replay", "--l2-gib", "inf"], None, [], "--l2-gib must be a finite number"),
    ("l2-gib-nan", ["replay", "--l2-gib", "nan"], None, [], "--l2-gib must be a finite number"),
    ("l2-gib-negative", ["replay", "--l2-gib", "-1"], None, [], "--l2-gib must be > 0"),
    ("l2-gib-absurd", ["replay", "--l2-gib", "1e9"], None, [], "--l2-gib must be at most"),
    ("l2-gib-beyond-ram", ["replay", "--l2-gib", "100000"], None, [], "GiB of host memory"),
    ("l2-gib-below-a-page", ["replay", "--l2-gib", "1e-9"], None, [], "holds no page"),
    ("l1-pages-zero", ["replay", "--l1-pages", "0"], None, [], "--l1-pages must be > 0"),
    ("l1-pages-terabytes", ["replay", "--l1-pages", str(10**13)], None, [], "--l1-pages must be at most"),
    ("l1-pages-beyond-ram", ["replay", "--l1-pages", str(2 * 10**9)], None, [], "GiB of host memory"),
    ("l1-pages-too-small", ["replay", "--l1-pages", "5"], None, [], "cannot hold the longest request"),
    ("l2-fraction-zero", ["replay", "--l2-fraction", "0"], None, [], "--l2-fraction must be > 0"),
    ("l2-fraction-above-one", ["replay", "--l2-fraction", "1.5"], None, [], "--l2-fraction must be at most 1"),
    ("tokens-per-block-zero", ["replay", "--tokens-per-block", "0"], None, [], "--tokens-per-block must be > 0"),
    ("tokens-per-block-not-pages", ["replay", "--tokens-per-block", "24"], None, [], "not a multiple of the page size"),
    ("limit-zero", ["replay", "--limit", "0"], None, [], "--limit must be > 0"),
    ("cp-size-zero", ["replay", "--cp-size", "0"], None, [], "--cp-size must be in [1, 64]"),
    ("cp-size-huge", ["replay", "--cp-size", "1000"], None, [], "--cp-size must be in [1, 64]"),
    ("seed-negative", ["replay", "--seed", "-3"], None, [], "--seed must be in"),
    ("not-a-number", ["replay", "--l1-pages", "many"], None, [], "invalid int value: 'many'"),
    ("unknown-flag", ["replay", "--no-such-flag", "3"], None, [], "unrecognized arguments"),
    ("unknown-model", ["replay", "--model", "gpt-5"], None, [], "invalid choice: 'gpt-5'"),
    ("unknown-policy", ["replay", "--policy", "fifo"], None, [], "invalid choice: 'fifo'"),
    ("trace-missing", ["replay", "--trace", "/nonexistent/t.jsonl"], None, [], "no such file"),
    ("trace-is-a-directory", ["replay", "--trace"], _dir("traces"), [], "is a directory"),
    ("trace-bad-json", ["replay", "--trace"], _file("t.jsonl", GOOD_LINE + "{oops\n"), [], ":2: bad JSON"),
    ("trace-empty", ["replay", "--trace"], _file("t.jsonl", "\n\n"), [], "trace has no requests"),
    ("trace-hash-id-2**64", ["replay", "--trace"],
     _file("t.jsonl", GOOD_LINE.replace("[1, 2]", f"[1, {2**64}]")), [], "must be in [0, 2**63)"),
    ("trace-ids-vs-length", ["replay", "--trace"],
     _file("t.jsonl", GOOD_LINE.replace("[1, 2]", "[1]")), [], "needs ceil(600/512) = 2"),
    ("trace-negative-length", ["replay", "--trace"],
     _file("t.jsonl", '{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}\n'), [],
     "'input_length' must be in"),
    ("config-missing", ["replay", "--config", "/nonexistent/c.toml"], None, [], "no such file"),
    ("config-is-a-directory", ["replay", "--config"], _dir("conf"), [], "is a directory"),
    ("config-bad-toml", ["replay", "--config"], _file("c.toml", "page_size = = 3\n"), [], "c.toml"),
    ("config-wrong-type", ["replay", "--config"], _file("c.toml", 'page_size = "big"\n'), [], "page_size"),
    ("config-bool-type", ["replay", "--config"], _file("c.toml", "debug_checks = 3\n"), [], "debug_checks"),
    ("config-unknown-field", ["replay", "--config"], _file("c.toml", "pagesize = 64\n"), [], "pagesize"),
    ("config-bad-budget", ["replay", "--config"], _file("c.toml", 'host_budget_bytes = "lots"\n'), [],
     "host_budget_bytes"),
    ("set-without-equals", ["replay", "--set", "page_size"], None, [], "expected FIELD=VALUE"),
    ("set-unknown-field", ["replay", "--set", "colour=blue"], None, [], "colour"),
    ("set-bad-value", ["replay", "--set", "page_size=0"], None, [], "page_size"),
    ("set-contradicts-flag", ["replay", "--set", "model=deepseek-v3.2", "--model", "tiny"], None, [],
     "contradicts"),
    ("device-unknown", ["replay", "--device", "tpu"], None, [], "--device 'tpu'"),
    ("device-cuda-missing", ["replay", "--device", "cuda"], None, [], "no CUDA device"),
    ("json-is-a-directory", ["replay", "--json"], _dir("out"), [], "is a directory"),
    ("json-under-a-file", ["replay", "--json"], lambda d: [str(_file("f", "x")(d)[0]) + "/r.json"], [],
     "is not a directory"),
    ("plot-is-a-directory", ["replay", "--plot"], _dir("plots"), [], "is a directory"),
    ("metrics-port-out-of-range", ["replay", "--metrics-port", "70000"], None, [], "--metrics-port must be in"),
    # issue 29: every value checked at one boundary, naming the field and its source
    ("toml-model-layout-string", ["replay", "--config"], _file("c.toml", 'model_layout = "x"\n'), [],
     "model_layout: expected a table"),
    ("toml-model-layout-int", ["replay", "--config"], _file("c.toml", "model_layout = 5\n"), [],
     "model_layout: expected a table"),
    ("toml-state-layers-string", ["replay", "--config"], _file("c.toml", '[model_layout]\nstate_layers = "ab"\n'), [],
     "model_layout.state_layers: expected a list"),
    ("toml-state-layers-int", ["replay", "--config"], _file("c.toml", "[model_layout]\nstate_layers = 5\n"), [],
     "model_layout.state_layers: expected a list"),
    ("toml-write-policy-int", ["replay", "--config"], _file("c.toml", "write_policy = 5\n"), [],
     "write_policy: expected one of"),
    ("toml-l2-exclusive-string", ["replay", "--config"], _file("c.toml", 'l2_exclusive = "yes"\n'), [],
     "l2_exclusive: expected a boolean, got the string 'yes' (from toml:"),
    ("toml-l3-master-int", ["replay", "--config"], _file("c.toml", "[l3]\nmaster = 5\n"), [],
     "l3.master: expected a string"),
    ("toml-l3-namespace-int", ["replay", "--config"], _file("c.toml", "[l3]\nnamespace = 5\n"), [],
     "l3.namespace: expected a string"),
    ("toml-l3-hostname-int", ["replay", "--config"], _file("c.toml", "[l3]\nlocal_hostname = 5\n"), [],
     "l3.local_hostname: expected a string"),
    ("toml-l3-timeout-nan", ["replay", "--config"], _file("c.toml", "[l3]\nprefetch_timeout_s = nan\n"), [],
     "l3.prefetch_timeout_s: must be a finite number"),
    ("toml-l3-enabled-contradiction", ["replay", "--config"],
     _file("c.toml", '[l3]\nenabled = false\nbackend = "mooncake"\n'), [], "contradicts l3.backend"),
    ("toml-cp-size-beyond-machine", ["replay", "--config"], _file("c.toml", "cp_size = 200\n"), [],
     "cp_size 200 (from toml:"),
    ("set-cp-size-beyond-machine", ["replay", "--set", "cp_size=200"], None, [], "cp_size 200 (from cli)"),
    ("set-l3-unknown-field", ["replay", "--set", "l3.pages_per_objet=2"], None, [], "l3: unknown field"),
    ("set-l3-bad-value", ["replay", "--set", "l3.pages_per_object=x"], None, [], "l3.pages_per_object: expected int"),
    ("set-and-l1-pages", ["replay", "--l1-pages", "500", "--set", "l1_pages=3000"], None, [], "both size l1_pages"),
    ("set-and-l2-gib", ["replay", "--l2-gib", "1", "--set", "host_budget_bytes=100000000"], None, [],
     "both size host_budget_bytes"),
    ("instances-beyond-machine", ["replay", "--instances", "200"], None, [], "--instances 200 (from cli) exceeds"),
    ("instances-100000", ["replay", "--instances", "100000"], None, [], "exceeds what this machine runs"),
    ("json-on-proc", ["replay", "--json", "/proc/x.json"], None, [], "kernel file system (proc)"),
    ("json-on-sys", ["replay", "--json", "/sys/x.json"], None, [], "kernel file system (sysfs)"),
    ("plot-on-proc", ["replay", "--plot", "/proc/x.png"], None, [], "kernel file system (proc)"),
    ("json-dev-null", ["replay", "--json", "/dev/null"], None, [], "is not a regular file"),
    ("json-fifo", ["replay", "--json"], lambda d: [_fifo(d)], [], "is not a regular file"),
    ("json-symlink", ["replay", "--json"], lambda d: [_symlink(d)], [], "is a symbolic link"),
    ("metrics-addr-hostname", ["replay", "--metrics-port", "9100", "--metrics-addr", "localhost"], None, [],
     "expected an IP address"),
    ("metrics-addr-without-port", ["replay", "--metrics-addr", "::1"], None, [], "needs --metrics-port"),
    ("metrics-port-in-use", ["replay", "--metrics-port"], lambda d: [str(_busy_port())], [], "is not free"),
    ("trace-deep-nesting", ["replay", "--trace"], _file("deep.jsonl", "[" * 200_000 + "\n"), [], "nested 200000 deep"),
    ("l3-master-unreachable", ["replay", "--limit", "3", "--l3", "mooncake", "--l3-master", "127.0.0.1:1"], None, [],
     "no Mooncake master accepts connections at 127.0.0.1:1 within 5 s"),
    ("bench-l3-master-unreachable", ["bench-l3", "--l3-master", "127.0.0.1:1"], None, [],
     "no Mooncake master accepts connections"),
    ("bench-l3-page-size-zero", ["bench-l3", "--page-size", "0"], None, [], "--page-size must be in [1"),
    ("io-backend-direct-without-cuda", ["replay", "--device", "cpu", "--io-backend", "direct"], None, [],
     "copies with CUDA"),
    ("pin-host-without-cuda", ["replay", "--device", "cpu", "--set", "pin_host=true"], None, [], "needs CUDA"),
    ("plot-with-cp", ["replay", "--cp-size", "2", "--plot"], lambda d: [str(d / "p.png")], [], "--plot draws one"),
    ("plot-with-instances", ["replay", "--instances", "2", "--plot"], lambda d: [str(d / "p.png")], [],
     "--plot draws one"),
    ("bench-alloc-pool-gib-inf", ["bench-alloc", "--pool-gib", "inf"], None, [], "--pool-gib must be a finite number"),
    ("bench-alloc-seed-negative", ["bench-alloc", "--seed", "-1"], None, [], "--seed must be >= 0, got -1"),
    ("bench-alloc-page-bytes-empty", ["bench-alloc", "--page-bytes", ""], None, [], "--page-bytes lists no page size"),
    ("bench-alloc-page-tokens-zero", ["bench-alloc", "--page-tokens", "0"], None, [], "--page-tokens must be positive"),
    ("bench-pinning-json-on-proc", ["bench-pinning", "--json", "/proc/pin.json"], None, [],
     "--json /proc/pin.json: /proc is on a kernel file system (proc)"),
    ("hf-time-scale-nan", ["replay", "--engine", "hf", "--arrivals", "trace", "--time-scale", "nan"], None, [],
     "--time-scale must be a finite number > 0"),
    ("hf-time-scale-inf", ["replay", "--engine", "hf", "--arrivals", "trace", "--time-scale", "inf"], None, [],
     "--time-scale must be a finite number > 0"),
    ("hf-time-scale-zero", ["replay", "--engine", "hf", "--arrivals", "trace", "--time-scale", "0"], None, [],
     "--time-scale must be a finite number > 0"),
    ("hf-time-scale-negative", ["replay", "--engine", "hf", "--arrivals", "trace", "--time-scale", "-1"], None, [],
     "--time-scale must be a finite number > 0"),
    ("hf-flag-without-engine-hf-seed", ["replay", *['--hf-seed', '3']], None, [], "--hf-seed (from cli) is an option of the hf engine; it needs --engine hf"),
    ("hf-flag-without-engine-arrivals", ["replay", *['--arrivals', 'trace']], None, [], "--arrivals (from cli) is an option of the hf engine; it needs --engine hf"),
    ("hf-flag-without-engine-compare-no-l2", ["replay", *['--compare-no-l2']], None, [], "--compare-no-l2 (from cli) is an option of the hf engine; it needs --engine hf"),
    ("hf-flag-without-engine-time-scale", ["replay", *['--engine', 'synthetic', '--time-scale', '2']], None, [], "--time-scale (from cli) is an option of the hf engine; it needs --engine hf"),
    ("hf-page-size-conflict", ["replay", "--engine", "hf", "--set", "page_size=32"], None, [],
     "page_size = 32 (from cli) contradicts engine:hf:tiny, which runs with page_size = 8"),
    ("hf-page-size-toml-conflict", ["replay", "--engine", "hf", "--config"], _file("c.toml", "page_size = 32\n"), [],
     "contradicts engine:hf:tiny"),
    ("bench-pd-zero-pages", ["bench-pd", "--pages", "0"], None, [], "--pages must be in [1"),
    ("bench-pd-zero-repeats", ["bench-pd", "--repeats", "0"], None, [], "--repeats must be in [1"),
    ("bench-pd-l2-fraction", ["bench-pd", "--l2-fraction", "2"], None, [], "--l2-fraction must be in [0, 1]"),
    ("bench-pd-bad-layer-ids", ["bench-pd", "--state-layers", "x,y"], None, [], "--state-layers 'x,y'"),
    ("bench-pd-no-layers", ["bench-pd", "--num-layers", "0"], None, [], "layout: num_layers must be > 0"),
    ("decode-peer-zero-pages", ["decode-peer", "--pages", "0"], None, [], "--pages must be in [1"),
    ("decode-peer-bad-port", ["decode-peer", "--port", "99999"], None, [], "--port must be in [0, 65535]"),
]


_BUSY: list[socket.socket] = []


def _busy_port() -> int:
    """A port something listens on (kept open for the session)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    _BUSY.append(s)
    return int(s.getsockname()[1])


def _fifo(d: Path) -> str:
    path = d / "report.fifo"
    os.mkfifo(path)
    return str(path)


def _symlink(d: Path) -> str:
    path = d / "link.json"
    path.symlink_to(d / "elsewhere.json")
    return str(path)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(case, tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    _, before, setup, after, fragment = case
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HICACHE_CP_PD_AUTHKEY", raising=False)
    inputs = setup(tmp_path) if setup else []
    written = set(os.listdir(tmp_path))
    argv = [*before, *inputs, *after]
    if argv[0] == "replay" and "--json" not in argv:
        argv += ["--json", str(tmp_path / "report.json")]
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse's own errors end the process
        rc = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1, err
    assert fragment in err[0], err
    assert set(os.listdir(tmp_path)) == written, "a failed command left files behind"


def test_argparse_errors_exit_2(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as info:
        main(["replay", "--limit", "many"])
    assert info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_env_value_error_names_the_variable(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("HICACHE_L1_PAGES", "many")
    assert main(["replay"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "l1_pages" in err[0]


@pytest.mark.parametrize(
    "argv, module, extra",
    [
        (["replay", "--plot", "p.png"], "matplotlib", "plot"),
        (["replay", "--pd"], "mooncake", "pd"),
        (["replay", "--metrics-port", "9464"], "prometheus_client", "metrics"),
        (["bench-pd"], "mooncake", "pd"),
    ],
)
def test_missing_extra_names_it(argv, module, extra, tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    for name in [n for n in sys.modules if n == module or n.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # "import module" now raises ImportError
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"hicache-cp[{extra}]" in err[0], err
    assert os.listdir(tmp_path) == []


def test_internal_errors_exit_3_not_2(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """A ValueError from inside the library (here: an allocator double free) is
    a bug, not bad input: exit 3, with the traceback under -v."""
    from hicache_harness.replay import command

    def broken(args):  # type: ignore[no-untyped-def]
        raise ValueError("L2 rank 0 lane 0: pages [3] are already free")

    monkeypatch.setattr(command, "replay", broken)
    assert main(["replay"]) == 3
    err = capsys.readouterr().err
    assert "internal error: ValueError" in err and "Traceback" not in err
    assert main(["replay", "-v"]) == 3
    assert "Traceback" in capsys.readouterr().err


ENV_CASES = [
    ("unknown-variable-strict", {"HICACHE_L1_PAGS": "5", "HICACHE_STRICT_ENV": "1"},
     "HICACHE_L1_PAGS is not a hicache-cp setting; did you mean HICACHE_L1_PAGES?"),
    ("unknown-l3-variable-strict", {"HICACHE_L3_PAGES_PER_OBJ": "5", "HICACHE_STRICT_ENV": "1"},
     "did you mean HICACHE_L3_PAGES_PER_OBJECT?"),
    ("l3-variable-bad-value", {"HICACHE_L3_PAGES_PER_OBJECT": "abc"}, "(from env:HICACHE_L3_PAGES_PER_OBJECT)"),
    ("rank-timeout-not-a-number", {"HICACHE_CP_RANK_TIMEOUT_S": "abc"}, "HICACHE_CP_RANK_TIMEOUT_S='abc'"),
    ("rank-timeout-negative", {"HICACHE_CP_RANK_TIMEOUT_S": "-1"}, "HICACHE_CP_RANK_TIMEOUT_S='-1'"),
    ("rank-timeout-inf", {"HICACHE_CP_RANK_TIMEOUT_S": "inf"}, "expected a finite number of seconds"),
    ("cp-size-beyond-machine", {"HICACHE_CP_SIZE": "200"}, "cp_size 200 (from env:HICACHE_CP_SIZE)"),
    ("l2-exclusive-word", {"HICACHE_L2_EXCLUSIVE": "maybe"}, "l2_exclusive"),
]


@pytest.mark.parametrize("case", ENV_CASES, ids=[c[0] for c in ENV_CASES])
def test_bad_environment_exits_2_naming_the_variable(case, tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    _, env, fragment = case
    monkeypatch.chdir(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["replay", "--json", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "r.json").exists()


def test_trace_lines_split_on_newline_only(tmp_path: Path) -> None:
    """Raw U+2028 and U+0085 are valid inside a JSON string: not line ends."""
    import json

    from hicache_harness.trace import load_trace

    line = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2],
                       "note": "a\u2028b\u0085c\u000bd"}, ensure_ascii=False)  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n" + line + "\n", encoding="utf-8")
    assert [tuple(r.hash_ids) for r in load_trace(path)] == [(1, 2), (1, 2)]


def test_non_field_hicache_variables_are_accepted() -> None:
    """The project's own non-field variables are not mistaken for misspelt fields."""
    from hicache_cp.config import NON_FIELD_ENV, Config

    env = dict.fromkeys(NON_FIELD_ENV, "1") | {"HICACHE_L1_PAGES": "100"}
    assert Config.resolve(env=env).config.l1_pages == 100
    assert {"HICACHE_CP_CONFIG", "HICACHE_PEERS", "HICACHE_COMMIT"} <= NON_FIELD_ENV


def test_hf_engine_records_its_page_size_and_source(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The page size the hf engine runs with is in the report with the engine as its
    source (a page size the config agrees with is accepted)."""
    import json

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    assert main(["replay", "--engine", "hf", "--set", "page_size=8", "--limit", "2", "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["page_size"] == {"value": 8, "source": "engine:hf:tiny"}
    assert config["model_layout"]["source"] == "engine:hf:tiny"


@pytest.mark.parametrize("source", ["toml", "env", "flag", "default"])
def test_bench_overhead_honours_every_source(source: str, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """bench-overhead's model and page size come through the one config boundary, recorded with their source."""
    import json

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HICACHE_PAGE_SIZE", raising=False)
    monkeypatch.delenv("HICACHE_MODEL", raising=False)
    argv = ["bench-overhead", "--limit", "5", "--json", str(tmp_path / "o.json")]
    expected = {"model": ("tiny", "toml:"), "page_size": (32, "toml:")}
    if source == "toml":
        (tmp_path / "c.toml").write_text('model = "tiny"\npage_size = 32\n')
        argv += ["--config", str(tmp_path / "c.toml")]
    elif source == "env":
        monkeypatch.setenv("HICACHE_MODEL", "tiny")
        monkeypatch.setenv("HICACHE_PAGE_SIZE", "32")
        expected = {"model": ("tiny", "env:HICACHE_MODEL"), "page_size": (32, "env:HICACHE_PAGE_SIZE")}
    elif source == "flag":
        argv += ["--model", "tiny", "--page-size", "32"]
        expected = {"model": ("tiny", "cli"), "page_size": (32, "cli")}
    else:
        expected = {"model": ("deepseek-v3.2", "default:bench-overhead"), "page_size": (64, "default:bench-overhead")}
    assert main(argv) == 0
    r = json.loads((tmp_path / "o.json").read_text())
    for name, (value, src) in expected.items():
        assert r[name] == value and r["config"][name]["value"] == value, (name, r[name], r["config"][name])
        assert r["config"][name]["source"].startswith(src), (name, r["config"][name])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--io-variant", "direct-hook99"], "--io-variant 'direct-hook99': unknown; known: hybrid"),
        (["--io-variant", "direct-hook16", "--io-backend", "cpu"], "--io-variant names its backend"),
        (["--io-variant", "direct-hook16", "--device", "cpu"], "io_backend = direct (from cli) copies with CUDA"),
    ],
)
def test_bench_overhead_refuses_a_bad_io_variant(extra: list[str], message: str, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """An unknown variant, a variant beside --io-backend and a CUDA variant on a CPU L1:
    one error line naming the problem, exit 2, no results written."""
    out = tmp_path / "o.json"
    assert main(["bench-overhead", "--limit", "2", "--json", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_an_interrupt_unwinding_the_cli_imports_nothing(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """An interrupt mid-import unwinds through the CLI's except clauses: their
    expressions must not import (numpy half-loaded: "cannot load module more
    than once per process", a traceback instead of exit 130)."""
    import signal

    from hicache_harness import cli, errors, lifetime

    def interrupted(argv):  # type: ignore[no-untyped-def]
        raise lifetime.Interrupted(signal.SIGINT)

    def bad_input_types():  # type: ignore[no-untyped-def]
        if sys.exc_info()[0] is not None:
            raise ImportError("cannot load module more than once per process")
        return errors.bad_input_types()

    monkeypatch.setattr(cli, "build_parser", interrupted)
    monkeypatch.setattr(cli, "bad_input_types", bad_input_types)
    assert main(["replay"]) == 130
    assert capsys.readouterr().err.strip() == "hicache-cp: interrupted by SIGINT"
