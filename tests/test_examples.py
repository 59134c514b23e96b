"""examples/ runs, or parses with the engines' own parsers where it needs a GPU server.

- examples/library.py runs here (CPU) and serves a miss, an L1 hit and an L2 hit;
- examples/sglang/hicache.toml resolves under SGLang's pools through the plug-in's own
  settings (`integrations.sglang.settings.resolve`), and launch.sh's flags parse with
  SGLang's `ServerArgs` parser, naming a radix-cache backend SGLang's plug-in loader
  registers;
- examples/vllm/serve.sh's flags parse with vLLM's `EngineArgs` parser into a KV-transfer
  config whose module path holds the connector and whose extra config the connector takes.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def exec_argv(script: Path) -> list[str]:
    """The argv of the script's `exec` line: continuations joined, `${VAR:-default}` as its
    default, `"$@"` dropped."""
    text = script.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("exec "))
    line = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", line)
    return [w for w in shlex.split(line)[1:] if w != "$@"]


def test_the_library_example_serves_a_miss_an_l1_hit_and_an_l2_hit() -> None:
    spec = importlib.util.spec_from_file_location("example_library", EXAMPLES / "library.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    got = module.main()
    assert (got["first_l1"], got["first_l2"]) == (0, 0)
    assert got["second_l1"] == 10 and got["third_l2"] == 10
    assert got["backups_committed"] >= 1


def test_exec_argv_reads_the_scripts_as_the_shell_would() -> None:
    argv = exec_argv(EXAMPLES / "sglang" / "launch.sh")
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == "deepseek-ai/DeepSeek-V3.2"
    assert "$@" not in argv and not any("${" in w for w in argv)


@pytest.mark.slow
def test_the_sglang_example_config_resolves_under_sglangs_pools(tmp_path: Path) -> None:
    pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")
    from hicache_harness.sglang.env import import_sglang, publish_server_args
    from hicache_harness.sglang.server import ServerSpec, build_pools
    from hicache_cp.integrations.sglang.pools import SGLangKV
    from hicache_cp.integrations.sglang.settings import CONFIG_ENV, resolve

    import_sglang()
    publish_server_args(tmp_path, page_size=ServerSpec().page_size)
    pools = build_pools(ServerSpec())
    toml = EXAMPLES / "sglang" / "hicache.toml"
    resolved = resolve(SGLangKV.from_pools(pools.target, pools.drafts), env={CONFIG_ENV: str(toml)})
    assert resolved.config.host_budget_bytes == "auto"
    assert resolved.sources["host_budget_bytes"] == f"toml:{toml}"
    assert resolved.config.io_backend == "auto" and resolved.sources["page_size"] == "sglang"


@pytest.mark.slow
def test_the_sglang_launch_parses_with_sglangs_own_parser() -> None:
    pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")
    import argparse

    from hicache_harness.sglang.env import import_sglang

    import_sglang()
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    script = EXAMPLES / "sglang" / "launch.sh"
    assert 'HICACHE_CP_CONFIG:-$(dirname "$0")/hicache.toml' in script.read_text()
    argv = exec_argv(script)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv[argv.index("sglang.launch_server") + 1 :])
    assert args.page_size == 64 and args.radix_cache_backend == "hicache-cp"
    assert not getattr(args, "enable_hierarchical_cache", False)
    load_plugins()  # as every SGLang server process does before it reads --radix-cache-backend
    assert args.radix_cache_backend in registered_radix_cache_backends()


_VLLM_PARSE = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(sys.argv[1:])
kt = args.kv_transfer_config
print(json.dumps({"block_size": args.block_size, "model": args.model, "kv_connector": kt.kv_connector,
                  "module": kt.kv_connector_module_path, "role": kt.kv_role, "policy": kt.kv_load_failure_policy,
                  "extra": kt.kv_connector_extra_config}))
"""


@pytest.mark.slow
def test_the_vllm_launch_parses_with_vllms_own_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a child process: vLLM infers its device when it builds the parser, which takes
    VLLM_TARGET_DEVICE=cpu on a machine without a GPU. The settings are checked as on a
    serving host (2 TiB of memory): the example's 64 GiB is refused on a smaller machine."""
    pytest.importorskip("vllm", reason="vllm not installed (scripts/install_vllm.sh)")
    argv = exec_argv(EXAMPLES / "vllm" / "serve.sh")
    assert argv[:2] == ["vllm", "serve"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _VLLM_PARSE, "--model", argv[2], *argv[3:]], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["block_size"] == 64 and got["role"] == "kv_both" and got["policy"] == "recompute"
    module = importlib.import_module(got["module"])
    assert hasattr(module, got["kv_connector"]), (got["module"], got["kv_connector"])
    import types

    import hostmem.sizing
    from hicache_cp.integrations.vllm.settings import ConnectorSettings

    monkeypatch.setattr(hostmem.sizing, "host_memory", lambda **_: types.SimpleNamespace(total_bytes=2 << 40))
    assert ConnectorSettings.from_extra_config(got["extra"]).host_budget_bytes == 64 << 30
