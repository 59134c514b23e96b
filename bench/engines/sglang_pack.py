"""Pack SGLang 0.5.23's Python, the wheels its imports need and an `sgl_kernel` stand-in, for the device.

    .venv/bin/python bench/engines/sglang_pack.py [--dest .sglang]     # here, before the device call
    .venv/bin/python bench/engines/sglang_pack.py trace [--site DIR]    # the import trace on CPU, CUDA faked
    then the device call carries `.sglang` and runs bench/device/sglang.sh

The SGLang wheel cannot be installed on the device image: it pins torch 2.14.1
(the image has 2.11), and its `sgl-kernel` 0.4.10 binary does not load there
(five torch C++ symbols missing; docs/platform.md). What runs there is SGLang's
Python over the image's torch, its own JIT kernels (built on the device by its
`load_jit` with nvcc and apache-tvm-ffi) and its torch/Triton fallbacks. This
packs, into the ignored folder `.sglang/`:

    sglang-src.tar.gz   sglang/ from this venv's install without rust_extensions/*.so (the
                        HTTP/gRPC front ends), multimodal_gen/ and __pycache__, and without the
                        venv's Python-version-specific tree core; instead the Rust tree core
                        (`mem_cache/rust_tree_core/mem_cache.cpython-312-*.so`) of the cp312
                        manylinux wheel of the same release, pip-downloaded (skip with
                        --no-rust-core: SGLang then runs its Python tree core); sglang's
                        dist-info (version and entry points); a dist-info for hicache-cp whose
                        only content is its `sglang.srt.plugins` entry point (the device runs
                        the project from its tree, uninstalled, and SGLang's scheduler
                        processes find `--radix-cache-backend hicache-cp` through it); and
                        `sgl_kernel/` and `cutlass/`, the import-only stand-ins of
                        bench/engines/sglang_shims/
    whl/*.whl           wheels for Python 3.12 on manylinux x86-64 of what SGLang's imports need
                        that the device image lacks (KINDS.md's package list), at the versions
                        installed here (CARRY), and transformers 5.20 (SGLang pins 5.19; the
                        image has 5.17; --no-transformers leaves it out)
    manifest.json       what was packed, from where, and the sizes

`trace` imports SGLang's modules that the device runs use (TRACE_MODULES) in a
child process whose torch claims CUDA (an H100, capability 9.0) where it has
none (on the device the same command imports with the real GPU), with the
stand-in first on the path: every `if _is_cuda: from sgl_kernel import ...`
runs as it will on the device. It prints, as JSON, each module's outcome, the
stand-in names SGLang imported, modules missing from this environment (wheels
to carry) and the distributions loaded. `--site` puts a folder before the venv
(an unpacked sglang-src.tar.gz, to trace the packed tree itself).

Run where pip reaches the package index. Idempotent: wheels already in
.sglang/whl are kept. The total must stay near 40 MiB, so the tree and the
other carried files fit the 64 MiB a device call carries.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata as md
import io
import json
import os
import subprocess
import sys
import tarfile
import tomllib
import warnings
import zipfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "engines"))

from pack import add_tree, pip_download  # noqa: E402
SHIMS = REPO / "bench" / "engines" / "sglang_shims"
#: The stand-ins packed beside SGLang: sgl-kernel's names, and the CUTLASS DSL's (SGLang's Llama
#: MLP imports an SM100-only kernel written in it, never run on Hopper; sglang_shims/cutlass).
SHIM_PACKAGES = ("sgl_kernel", "cutlass")
SGLANG_VERSION = "0.5.23"
TRANSFORMERS = "transformers==5.20.2"
WHEEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hicache-cp" / "sglang-wheels"

#: Distributions SGLang 0.5.23's imports load (traced: `trace` on TRACE_MODULES) that the
#: device image lacks (/work/.library/device/KINDS.md, "Python packages already there");
#: the value pins a version this venv does not hold (None: the version installed here).
CARRY: dict[str, str | None] = {
    "annotated-types": None, "apache-tvm-ffi": None, "compressed-tensors": None, "dill": None, "fastapi": None,
    "gguf": None, "httpcore2": None, "httpx2": None, "ipython": None, "loguru": None, "msgspec": None, "openai": None,
    "opentelemetry-api": None, "orjson": None, "partial-json-parser": None, "pybase64": None, "pydantic": None,
    "pydantic_core": None, "pyzmq": None, "setproctitle": "1.3.8", "sniffio": None, "starlette": None,
    "traitlets": None, "truststore": None, "typing-inspection": None, "uvicorn": "0.55.0", "xgrammar": None,
}  # fmt: skip

#: The SGLang modules the device runs import (bench/device/sglang.sh: the plug-in's tests, the
#: race, SGLang's HiCache and its JIT kernels, sglang.Engine on a dense DeepSeek-V3 and a Llama).
TRACE_MODULES = (
    "sglang.srt.mem_cache.unified_radix_cache", "sglang.srt.managers.cache_controller",
    "sglang.srt.mem_cache.pool_host.mla", "sglang.srt.mem_cache.pool_host.dsa", "sglang.srt.mem_cache.pool_host.mha",
    "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler", "sglang.kernels.ops.kvcache.hicache",
    "sglang.srt.managers.schedule_policy", "sglang.srt.managers.scheduler", "sglang.srt.managers.tp_worker",
    "sglang.srt.model_executor.model_runner", "sglang.srt.models.deepseek_v2", "sglang.srt.models.llama",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.layers.sampler", "sglang.srt.model_loader.loader", "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager", "sglang.srt.plugins",
    "hicache_cp.integrations.sglang.radix_cache",  # what the scheduler's plug-in loader imports
)  # fmt: skip

SKIP_DIRS = ("srt/rust_extensions", "multimodal_gen")
TREE_CORE = "srt/mem_cache/rust_tree_core"
MAX_TOTAL = 44 << 20


def _skipped(rel: str) -> bool:
    """Paths under sglang/ left out of the pack (see the module docstring)."""
    parts = rel.split("/")
    if "__pycache__" in parts:
        return True
    if any(rel.startswith(d + "/") for d in SKIP_DIRS) and rel.endswith(".so"):
        return True
    if rel.startswith("multimodal_gen/"):
        return True
    return rel.startswith(TREE_CORE + "/") and ".cpython-" in parts[-1]


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def rust_tree_core() -> tuple[str, bytes]:
    """(file name, bytes) of the Rust tree core in SGLang's cp312 wheel (downloaded once)."""
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(WHEEL_CACHE.glob(f"sglang-{SGLANG_VERSION}-cp312-*.whl"))
    if not wheels:
        pip_download(WHEEL_CACHE, [f"sglang=={SGLANG_VERSION}"])
        wheels = sorted(WHEEL_CACHE.glob(f"sglang-{SGLANG_VERSION}-cp312-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        names = [n for n in z.namelist() if n.startswith(f"sglang/{TREE_CORE}/") and n.endswith(".so")]
        if len(names) != 1:
            raise SystemExit(f"error: {wheels[-1].name}: expected one tree-core .so, found {names}")
        return names[0], z.read(names[0])


def plugin_dist_info() -> dict[str, bytes]:
    """hicache-cp's dist-info files holding only its SGLang plug-in entry point (from pyproject.toml)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["sglang.srt.plugins"]
    info = f"hicache_cp-{project['version']}.dist-info"
    lines = ["[sglang.srt.plugins]", *(f"{k} = {v}" for k, v in plugins.items()), ""]
    meta = f"Metadata-Version: 2.1\nName: hicache-cp\nVersion: {project['version']}\n"
    return {f"{info}/METADATA": meta.encode(), f"{info}/entry_points.txt": "\n".join(lines).encode()}


def pack_sources(dest: Path, *, rust_core: bool) -> dict:
    dist = md.distribution("sglang")
    if dist.version != SGLANG_VERSION:
        raise SystemExit(f"error: sglang {dist.version} is installed here, not {SGLANG_VERSION} (scripts/install_sglang.sh)")
    pkg = Path(str(dist.locate_file("sglang")))
    out = dest / "sglang-src.tar.gz"
    core = None
    with tarfile.open(out, "w:gz", compresslevel=9) as tar:
        kept, skipped, kept_bytes = add_tree(tar, pkg, "sglang", _skipped)
        if rust_core:
            name, data = rust_tree_core()
            _add_bytes(tar, name, data)
            core = {"file": name, "bytes": len(data)}
        info = Path(str(dist.locate_file(""))) / f"sglang-{dist.version}.dist-info"
        for name in ("METADATA", "entry_points.txt", "top_level.txt"):
            if (info / name).exists():
                tar.add(info / name, arcname=f"{info.name}/{name}")
        for name, data in plugin_dist_info().items():
            _add_bytes(tar, name, data)
        shims = [path.relative_to(SHIMS).as_posix() for package in SHIM_PACKAGES for path in sorted((SHIMS / package).rglob("*.py"))]
        for shim in shims:
            _add_bytes(tar, shim, (SHIMS / shim).read_bytes())
    return {"version": dist.version, "from": str(pkg), "files": kept, "bytes": kept_bytes, "skipped_files": skipped,
            "rust_tree_core": core, "tarball_bytes": out.stat().st_size, "shims": shims}  # fmt: skip


def download_wheels(dest: Path, *, transformers: bool) -> list[str]:
    whl = dest / "whl"
    whl.mkdir(parents=True, exist_ok=True)
    pins = []
    for name, version in CARRY.items():
        try:
            pins.append(f"{name}=={version or md.version(name)}")
        except md.PackageNotFoundError:
            raise SystemExit(f"error: {name} is not installed here; scripts/install_sglang.sh first") from None
    if transformers:
        pins.append(TRANSFORMERS)

    def norm(s: str) -> str:
        return s.lower().replace("_", "-")

    have = {norm(p.name.split("-")[0]) for p in whl.glob("*.whl")}
    need = [p for p in pins if norm(p.split("==")[0]) not in have]
    if need:
        pip_download(whl, need)
    return sorted(p.name for p in whl.glob("*.whl"))


# ---- what SGLang imports from sgl_kernel (static) -----------------------------------------


def sgl_kernel_imports(pkg: Path) -> dict[str, dict[str, set[str]]]:
    """`from sgl_kernel[.sub] import NAME` in SGLang's sources (without multimodal_gen, its
    tests and the NPU backend): module -> name -> where ({"module", "function"}, each with
    "-guarded" when inside a `try` that catches ImportError or a broader exception)."""
    found: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        if rel.startswith(("multimodal_gen/", "test/")) or "/npu/" in rel:
            continue
        text = path.read_text(errors="replace")
        if "sgl_kernel" not in text:
            continue
        with warnings.catch_warnings():  # SGLang's own invalid escapes in strings are not ours to report
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            tree = ast.parse(text)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sgl_kernel"):
                continue
            guarded = in_function = False
            up = node
            while up in parents:
                up = parents[up]
                if isinstance(up, ast.Try) and any(_catches_import_error(h) for h in up.handlers):
                    guarded = True
                in_function |= isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef))
            where = ("function" if in_function else "module") + ("-guarded" if guarded else "")
            for alias in node.names:
                found[node.module][alias.name].add(where)
    return {m: dict(names) for m, names in found.items()}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    text = ast.unparse(handler.type)
    return any(name in text for name in ("ImportError", "ModuleNotFoundError", "Exception", "AttributeError"))


# ---- the import trace (CUDA faked) --------------------------------------------------------

_CHILD = "_trace-child"


def trace(sites: list[Path], modules: list[str]) -> dict:
    """Run the import trace in a child process (it fakes CUDA process-wide); its JSON."""
    env = dict(os.environ)
    path = [str(SHIMS), *map(str, sites), str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] = "1"
    out = subprocess.run([sys.executable, __file__, _CHILD, *modules], env=env, capture_output=True, text=True,
                         timeout=900, check=False)  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"trace child exited {out.returncode}:\n{out.stderr[-4000:]}")
    return json.loads(lines[-1])


def torch_has_cuda_build() -> bool:
    import torch

    return torch.version.cuda is not None


def _fake_cuda() -> None:
    """torch says it has CUDA (one H100), so SGLang takes its CUDA import paths."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3"


def fake_cuda_for_imports() -> None:
    """What the trace child does before importing SGLang on a machine without a GPU: torch
    claims one (`_fake_cuda`, with 80 GiB free for SGLang's memory sizing), the torchvision
    stand-in where torch is a CPU build, sgl-kernel's version check off. Process-wide:
    call it in a process of its own (the trace child, `bench/engines/sglang_engine.py --check-args`)."""
    import torch

    os.environ.setdefault("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1")
    cpu_build = not torch_has_cuda_build()  # before `_fake_cuda` names a CUDA version
    _fake_cuda()
    torch.cuda.mem_get_info = lambda *a, **k: (80 << 30, 80 << 30)
    if cpu_build:
        _stand_in_torchvision()


def _stand_in_torchvision() -> None:
    """On this CPU machine torchvision does not load beside the CPU torch: the CPU harness's
    stand-in (hicache_harness.sglang.env), kept for the whole trace, since with CUDA
    faked more of SGLang imports it than the harness's configs."""
    from transformers.utils import import_utils

    from hicache_harness.sglang import env

    import_utils.is_torchvision_available()  # cached before the stand-in exists: absent
    for name in env._STAND_INS:  # noqa: SLF001 - the harness's own stand-in, reused
        sys.modules.setdefault(name, env._stand_in(name))  # noqa: SLF001


def _trace_child(modules: list[str]) -> int:
    import importlib
    import traceback

    import torch

    cpu_build = not torch_has_cuda_build()
    faked = not torch.cuda.is_available()
    if faked:
        _fake_cuda()
    if cpu_build:
        _stand_in_torchvision()
    from sgl_kernel._not_built import NotBuilt

    results: dict[str, str] = {}
    missing: set[str] = set()
    for name in modules:
        try:
            importlib.import_module(name)
            results[name] = "ok"
        except ModuleNotFoundError as exc:
            missing.add(str(exc.name))
            results[name] = f"ModuleNotFoundError: {exc}"
        except Exception as exc:  # noqa: BLE001 - the outcome is the record
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            results[name] = f"{type(exc).__name__}: {exc} ({Path(frame.filename).name}:{frame.lineno})"
    imported: dict[str, set[str]] = defaultdict(set)
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("sglang") or mod is None:
            continue
        for value in list(vars(mod).values()):
            if isinstance(value, NotBuilt):
                imported[value._name.rpartition(".")[0]].add(value._name.rpartition(".")[2])  # noqa: SLF001
    tops = {m.split(".")[0] for m in sys.modules}
    owners = md.packages_distributions()
    dists = sorted({d for t in tops for d in owners.get(t, [])})
    print(json.dumps({"cuda": "faked" if faked else torch.cuda.get_device_name(0), "modules": results,
                      "missing": sorted(missing), "distributions": dists,
                      "sgl_kernel_imported": {k: sorted(v) for k, v in sorted(imported.items())},
                      "sgl_kernel_from": getattr(sys.modules.get("sgl_kernel"), "__file__", None),
                      "sglang_from": getattr(sys.modules.get("sglang"), "__file__", None)}))
    return 0 if all(v == "ok" for v in results.values()) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [_CHILD]:
        return _trace_child(argv[1:])
    if argv[:1] == ["trace"]:
        ap = argparse.ArgumentParser(prog="sglang_pack.py trace")
        ap.add_argument("--site", type=Path, action="append", default=[], help="a folder before the venv's packages")
        ap.add_argument("modules", nargs="*", default=list(TRACE_MODULES))
        args = ap.parse_args(argv[1:])
        result = trace(args.site, args.modules)
        print(json.dumps(result, indent=1))
        return 0 if all(v == "ok" for v in result["modules"].values()) else 1
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=REPO / ".sglang")
    ap.add_argument("--no-rust-core", action="store_true", help="leave SGLang's Rust tree core out (Python core runs)")
    ap.add_argument("--no-transformers", action="store_true", help="leave transformers 5.20 out (the image has 5.17)")
    args = ap.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    sources = pack_sources(args.dest, rust_core=not args.no_rust_core)
    wheels = download_wheels(args.dest, transformers=not args.no_transformers)
    total = sum(p.stat().st_size for p in args.dest.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {"sglang": sources, "wheels": wheels, "total_bytes": total}
    (args.dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"sglang {sources['version']}: {sources['files']} files ({sources['bytes'] / 1e6:.1f} MB) -> "
          f"{sources['tarball_bytes'] / 2**20:.1f} MiB tarball; {len(wheels)} wheels; {total / 2**20:.1f} MiB in {args.dest}")
    if total > MAX_TOTAL:
        print(f"error: {total / 2**20:.1f} MiB leaves too little of the 64 MiB a device call carries", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
