"""`bench/engines/sglang_pack.py` and its `sgl_kernel` stand-in (bench/engines/sglang_shims), on CPU.

The stand-in must let SGLang import on a CUDA machine without sgl-kernel, and
must fail loudly the moment anything of it is called: every name raises
`NotImplementedError` naming the op; every name SGLang imports outside an
ImportError fallback is there; none that SGLang imports only with a fallback
is (SGLang's fallback must run). The import trace imports SGLang's modules
with torch claiming CUDA, as they will import on the device.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import re
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIMS = ROOT / "bench" / "engines" / "sglang_shims"
_spec = importlib.util.spec_from_file_location("sglang_pack", ROOT / "bench" / "engines" / "sglang_pack.py")
pack = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["sglang_pack"] = pack
_spec.loader.exec_module(pack)  # type: ignore[union-attr]

SUBMODULES = ("elementwise", "flash_attn", "kvcacheio", "mamba", "quantization", "scalar_type", "speculative", "utils")


@pytest.fixture
def stand_in() -> Iterator[dict[str, ModuleType]]:
    """The stand-in's modules, imported from bench/engines/sglang_shims and removed again afterwards
    (no other test may see an `sgl_kernel` in this process)."""
    assert "sgl_kernel" not in sys.modules, "an sgl_kernel is already imported in this process"
    sys.path.insert(0, str(SHIMS))
    try:
        mods = {"": importlib.import_module("sgl_kernel")}
        mods.update({s: importlib.import_module(f"sgl_kernel.{s}") for s in SUBMODULES})
        yield mods
    finally:
        sys.path.remove(str(SHIMS))
        for name in [n for n in sys.modules if n == "sgl_kernel" or n.startswith("sgl_kernel.")]:
            del sys.modules[name]


def _exported(stand_in: dict[str, ModuleType]) -> dict[str, set[str]]:
    not_built = stand_in[""]._not_built.NotBuilt
    out = {}
    for sub, mod in stand_in.items():
        module = "sgl_kernel" + (f".{sub}" if sub else "")
        out[module] = {k for k, v in vars(mod).items() if isinstance(v, not_built)}
    return out


def test_every_name_raises_not_implemented_naming_the_op(stand_in: dict[str, ModuleType]) -> None:
    exported = _exported(stand_in)
    assert sum(map(len, exported.values())) > 100
    for module, names in exported.items():
        mod = sys.modules[module]
        for name in names:
            with pytest.raises(NotImplementedError, match=rf"^{re.escape(module)}\.{name}: sgl-kernel is not on"):
                getattr(mod, name)(1, key="value")
    # Chained names (scalar_types.uint4b8) import and raise the same way, with their full name.
    scalar = stand_in["scalar_type"].scalar_types.uint4b8
    with pytest.raises(NotImplementedError, match=r"^sgl_kernel\.scalar_type\.scalar_types\.uint4b8\.size_bits: .*bf16 weights"):
        scalar.size_bits()
    with pytest.raises(NotImplementedError, match="transfer.*csrc|own JIT kernels"):
        stand_in["kvcacheio"].transfer_kv_per_layer_mla_pf_lf(src=None)


def test_the_one_executed_name_is_a_capability_query_answered_false(stand_in: dict[str, ModuleType]) -> None:
    assert stand_in["utils"].is_arch_support_pdl() is False


def test_names_sglang_imports_with_a_fallback_are_left_out(stand_in: dict[str, ModuleType]) -> None:
    for module, name in (("sgl_kernel", "awq_dequantize"), ("sgl_kernel.kvcacheio", "get_device_accessible_ptr")):
        with pytest.raises(ImportError, match=name):
            exec(f"from {module} import {name}", {})  # noqa: S102 - the import statement SGLang runs


def _sglang_package() -> Path:
    pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")
    return Path(str(md.distribution("sglang").locate_file("sglang")))


def test_the_stand_in_covers_exactly_sglangs_unguarded_imports(stand_in: dict[str, ModuleType]) -> None:
    imports = pack.sgl_kernel_imports(_sglang_package())
    exported = _exported(stand_in)
    exported["sgl_kernel.utils"] = {"is_arch_support_pdl"}  # the answered query (a function, not NotBuilt)
    for module, names in imports.items():
        needed = {n for n, where in names.items() if where & {"module", "function"}}
        guarded_only = set(names) - needed
        assert needed <= exported.get(module, set()), (module, sorted(needed - exported.get(module, set())))
        assert not guarded_only & exported.get(module, set()), (module, sorted(guarded_only & exported[module]))
    assert set(exported) <= set(imports) | {"sgl_kernel"}


def test_the_readme_gives_every_name_a_reason(stand_in: dict[str, ModuleType]) -> None:
    readme = (SHIMS / "README.md").read_text()
    for reason in stand_in[""]._not_built.REASONS:
        assert f"| `{reason}` |" in readme, reason
    for module, names in _exported(stand_in).items():
        prefix = module.removeprefix("sgl_kernel").lstrip(".")
        for name in names:
            assert f"`{prefix + '.' if prefix else ''}{name}`" in readme, (module, name)


def test_the_pack_leaves_out_compiled_front_ends_and_keeps_jit_sources() -> None:
    assert pack._skipped("srt/rust_extensions/_server.cpython-311-x86_64-linux-gnu.so")
    assert pack._skipped("multimodal_gen/runtime/pipelines/x.py")
    assert pack._skipped("srt/__pycache__/utils.cpython-311.pyc")
    assert pack._skipped("srt/mem_cache/rust_tree_core/mem_cache.cpython-311-x86_64-linux-gnu.so")
    assert not pack._skipped("srt/mem_cache/rust_tree_core/extension.py")
    assert not pack._skipped("kernels/jit/csrc/kvcacheio/hicache.cuh")
    assert not pack._skipped("srt/rust_extensions/loader.py")


def test_the_plugin_dist_info_names_the_registered_entry_point() -> None:
    files = pack.plugin_dist_info()
    entry = next(v for k, v in files.items() if k.endswith("entry_points.txt")).decode()
    assert "[sglang.srt.plugins]\nhicache-cp = hicache_cp.integrations.sglang:register" in entry


def _check_trace(result: dict, sglang_from: Path) -> None:
    assert result["cuda"] == "faked"
    assert result["modules"] and all(v == "ok" for v in result["modules"].values()), result["modules"]
    assert result["sgl_kernel_from"] == str(SHIMS / "sgl_kernel" / "__init__.py")
    assert result["sglang_from"].startswith(str(sglang_from))
    imported = result["sgl_kernel_imported"]
    assert {"rmsnorm", "silu_and_mul"} <= set(imported["sgl_kernel"])
    assert "transfer_kv_per_layer_mla_pf_lf" in imported["sgl_kernel.kvcacheio"]


@pytest.mark.slow
def test_the_cutlass_stand_in_lets_sglangs_sm100_dual_gemm_import_and_never_run() -> None:
    """SGLang's Llama MLP imports its CUTLASS-DSL dual GEMM on CUDA: with the stand-in the module
    loads (its kernels decorated at import), SGLang's own predicate answers False off SM100,
    and any kernel of it raises naming itself."""
    import subprocess

    code = (
        "import sglang.kernels.ops.gemm.cutedsl_dual_gemm as m\n"
        "assert m.can_use_dual_gemm(16, 4096, 11008, m.DualGemmQuantMode.UNQUANT) is False\n"
        "try:\n    m._dual_gemm_sm100_wrapper(1, 2)\nexcept NotImplementedError as e:\n    print(e)\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": f"{SHIMS}:{ROOT}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cutlass.cute.experimental.jit(_dual_gemm_sm100_wrapper): the CUTLASS DSL is not on this machine" in out.stdout
    assert "SM100 only" in out.stdout


def test_the_pack_carries_both_stand_ins() -> None:
    packed = [path.relative_to(SHIMS).as_posix() for package in pack.SHIM_PACKAGES for path in (SHIMS / package).rglob("*.py")]
    assert "sgl_kernel/__init__.py" in packed and "cutlass/cute/runtime.py" in packed and "cutlass/_absent.py" in packed


def test_sglang_imports_with_cuda_faked_and_the_stand_in() -> None:
    result = pack.trace([], list(pack.TRACE_MODULES))
    _check_trace(result, _sglang_package())


@pytest.mark.slow
def test_the_packed_tree_imports_with_cuda_faked(tmp_path: Path) -> None:
    tarball = ROOT / ".sglang" / "sglang-src.tar.gz"
    if not tarball.exists():
        pytest.skip("not packed here (bench/engines/sglang_pack.py)")
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp_path, filter="data")
    result = pack.trace([tmp_path], ["sglang.srt.mem_cache.unified_radix_cache", "sglang.srt.models.deepseek_v2"])
    _check_trace(result, tmp_path)
