"""Pack vLLM 0.33.0's Python sources and the packages its imports need, for the device machine.

    .venv/bin/python bench/engines/vllm_pack.py [--dest .vllm]      # here, before the device call
    then the device call carries `.vllm` and runs bench/device/vllm.sh

The vLLM wheel cannot be installed on the device image: it pins torch 2.14
(the image has 2.11) and is 336 MB, most of it compiled code that the
connector's tests never run. This packs, from the vLLM installed in this
venv (scripts/install_vllm.sh):

    .vllm/vllm-src.tar.gz   vllm/ without compiled parts: every *.so, vllm-rs/ (Rust
                            front end), third_party/fmha_sm100 and third_party/deep_gemm
                            (CUDA sources and cubins), C/C++/CUDA headers and sources,
                            __pycache__; plus vllm's dist-info (metadata lookups), plus
                            the shims of bench/engines/vllm_shims/ (see that folder's README)
    .vllm/whl/*.whl         wheels for Python 3.12 on manylinux x86-64 of the
                            distributions vLLM's imports need that the device image
                            lacks (KINDS.md's package list), at the versions installed here
    .vllm/manifest.json     what was packed, from where, and the sizes
    .vllm/csrc/, .vllm/cutlass/include/
                            with --sdist and --cutlass (both registry packages, read and built,
                            never committed): the vLLM sdist's csrc files that
                            bench/engines/vllm_ops/build.py compiles on the device (`SOURCES` there)
                            and every header they include from it, and the headers
                            `cutlass/cutlass.h` needs from the nvidia-cutlass wheel;
                            --fetch DIR downloads both there with pip first (see `fetch`)

Run where pip reaches the package index. Idempotent: wheels already in
.vllm/whl are kept. The total must stay well inside the device call's 64 MiB.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "engines"))

from pack import add_tree, pip_download  # noqa: E402
SHIMS = REPO / "bench" / "engines" / "vllm_shims"

#: Distributions that vLLM 0.33.0's imports load (the scheduler, the KV-connector API,
#: config, the OffloadingConnector, and the GPU model runner's model loader, which imports
#: compressed-tensors for its quantization log) and that the device image does not have.
#: Found by importing those modules here and subtracting the image's package list
#: (/work/.library/device/KINDS.md, "Python packages already there").
CARRY = [
    "annotated-types", "apache-tvm-ffi", "cachetools", "cbor2", "compressed-tensors", "fastapi", "httpcore2", "httpx2",
    "loguru",
    "llguidance", "msgspec", "openai", "opentelemetry-api", "orjson", "oss-harmony",
    "partial-json-parser", "pybase64", "pydantic", "pydantic_core", "pyzmq", "sniffio",
    "starlette", "truststore", "typing-inspection", "typing_extensions", "xgrammar",
]

#: Paths under vllm/ that are compiled code or its sources, never imported by Python.
SKIP_DIRS = ("vllm-rs", "third_party/fmha_sm100", "third_party/deep_gemm", "__pycache__")
SKIP_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp", ".c", ".cubin", ".a", ".o")


def _skipped(rel: str) -> bool:
    parts = rel.split("/")
    if any(p == "__pycache__" for p in parts):
        return True
    if any(rel == d or rel.startswith(d + "/") for d in SKIP_DIRS):
        return True
    return rel.endswith(SKIP_SUFFIXES) or ".so." in parts[-1]


def pack_sources(dest: Path) -> dict:
    dist = md.distribution("vllm")
    pkg = Path(str(dist.locate_file("vllm")))
    if not (pkg / "__init__.py").exists():
        raise SystemExit(f"error: vllm is not installed at {pkg} (scripts/install_vllm.sh)")
    out = dest / "vllm-src.tar.gz"
    with tarfile.open(out, "w:gz", compresslevel=9) as tar:
        kept, skipped, kept_bytes = add_tree(tar, pkg, "vllm", _skipped)
        info = Path(str(dist.locate_file(""))) / f"vllm-{dist.version}.dist-info"
        for name in ("METADATA", "entry_points.txt", "top_level.txt"):
            if (info / name).exists():
                tar.add(info / name, arcname=f"{info.name}/{name}")
        # INSTALLER/RECORD-less dist-info is enough for importlib.metadata.version("vllm").
        shims = sorted(SHIMS.rglob("*.py"))
        for shim in shims:
            target = f"vllm/{shim.relative_to(SHIMS).as_posix()}"
            data = shim.read_bytes()
            ti = tarfile.TarInfo(target)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return {"version": dist.version, "from": str(pkg), "files": kept, "bytes": kept_bytes, "skipped_files": skipped,
            "tarball_bytes": out.stat().st_size, "shims": [s.relative_to(SHIMS).as_posix() for s in shims]}


def load_build_script():
    """bench/engines/vllm_ops/build.py as a module (by path: "build" is also a PyPI package's name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_ops_build", REPO / "bench" / "engines" / "vllm_ops" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def include_closure(roots: list[str], read, search: list[str]) -> set[str]:
    """The files reachable from `roots` through #include lines, as paths `read(path)` can
    open (None: no such file): each include is tried beside the including file, then under
    every `search` prefix; includes found nowhere (system, CUDA, torch) are left out."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        text = read(path)
        if text is None:
            continue
        seen.add(path)
        here = path.rsplit("/", 1)[0] if "/" in path else ""
        for inc in _INCLUDE.findall(text):
            for base in [here, *search]:
                cand = _norm(f"{base}/{inc}" if base else inc)
                if cand not in seen and read(cand) is not None:
                    todo.append(cand)
                    break
    return seen


def _norm(path: str) -> str:
    parts: list[str] = []
    for p in path.split("/"):
        if p == "..":
            parts.pop()
        elif p not in ("", "."):
            parts.append(p)
    return "/".join(parts)


def pack_csrc(dest: Path, sdist: Path, cutlass_wheel: Path) -> dict:
    """The csrc files bench/engines/vllm_ops/build.py compiles and their includes, from the sdist;
    the headers cutlass/cutlass.h needs, from the nvidia-cutlass wheel."""
    sources = load_build_script().SOURCES

    out = {}
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        members = {m.name: m for m in tar.getmembers() if m.isfile()}

        def read_sdist(path: str) -> str | None:
            m = members.get(f"{top}/{path}")
            return None if m is None else tar.extractfile(m).read().decode("utf-8", "replace")

        roots = [f"csrc/{s}" for s in sources]
        bindings = (REPO / "bench" / "engines" / "vllm_ops" / "bindings.cpp").read_text()
        roots += [f"csrc/{inc}" for inc in _INCLUDE.findall(bindings)]
        files = include_closure(roots, read_sdist, ["csrc"])
        shutil.rmtree(dest / "csrc", ignore_errors=True)
        for path in sorted(files):
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(members[f"{top}/{path}"]).read())
        out["csrc_files"] = len(files)
        out["sdist"] = sdist.name
    with zipfile.ZipFile(cutlass_wheel) as whl:
        prefix = "cutlass_library/source/include/"
        names = set(whl.namelist())

        def read_cutlass(path: str) -> str | None:
            name = prefix + path
            return whl.read(name).decode("utf-8", "replace") if name in names else None

        headers = include_closure(["cutlass/cutlass.h"], read_cutlass, [""])
        shutil.rmtree(dest / "cutlass", ignore_errors=True)
        for path in sorted(headers):
            target = dest / "cutlass" / "include" / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(whl.read(prefix + path))
        out["cutlass_headers"] = len(headers)
        out["cutlass_wheel"] = cutlass_wheel.name
    return out


SDIST = "vllm==0.33.0"
CUTLASS = "nvidia-cutlass==4.2.0.0"


def fetch(where: Path) -> tuple[Path, Path]:
    """Download the vLLM sdist and the nvidia-cutlass wheel into `where` with pip. pip
    prepares an sdist's metadata before saving it: vLLM's setup.py then needs
    setuptools-rust and setuptools-scm (installed into `where`/buildreqs, not the venv),
    `VLLM_TARGET_DEVICE=empty` (no compiler run) and `VLLM_VERSION_OVERRIDE` (else its
    version carries "+empty" and pip discards it as inconsistent)."""
    where.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    reqs = where / "buildreqs"
    subprocess.run([*pip, "install", "-q", "--target", str(reqs), "setuptools-rust", "setuptools-scm"], check=True)
    env = {**__import__("os").environ, "PYTHONPATH": str(reqs), "VLLM_TARGET_DEVICE": "empty",
           "VLLM_VERSION_OVERRIDE": SDIST.split("==")[1]}
    subprocess.run([*pip, "download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
                    "-d", str(where), SDIST], check=True, env=env)
    subprocess.run([*pip, "download", "-q", "--no-deps", "-d", str(where), CUTLASS], check=True)
    sdist = where / f"vllm-{SDIST.split('==')[1]}.tar.gz"
    wheel = next(where.glob("nvidia_cutlass-*.whl"))
    return sdist, wheel


def download_wheels(dest: Path) -> list[str]:
    whl = dest / "whl"
    whl.mkdir(parents=True, exist_ok=True)
    pins = []
    for name in CARRY:
        try:
            pins.append(f"{name}=={md.version(name)}")
        except md.PackageNotFoundError:
            raise SystemExit(f"error: {name} is not installed here; scripts/install_vllm.sh first") from None
    have = {p.name.split("-")[0].lower().replace("_", "-") for p in whl.glob("*.whl")}
    need = [p for p in pins if p.split("==")[0].lower().replace("_", "-") not in have]
    if need:
        pip_download(whl, need)
    return sorted(p.name for p in whl.glob("*.whl"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=REPO / ".vllm")
    ap.add_argument("--sdist", type=Path, help="vllm-0.33.0.tar.gz: pack the csrc the device build compiles")
    ap.add_argument("--cutlass", type=Path, help="the nvidia-cutlass wheel (with --sdist)")
    ap.add_argument("--fetch", type=Path, help="download the sdist and the cutlass wheel here, then pack them")
    args = ap.parse_args()
    if (args.sdist is None) != (args.cutlass is None):
        ap.error("--sdist and --cutlass go together")
    if args.fetch:
        args.sdist, args.cutlass = fetch(args.fetch)
    args.dest.mkdir(parents=True, exist_ok=True)
    sources = pack_sources(args.dest)
    wheels = download_wheels(args.dest)
    csrc = pack_csrc(args.dest, args.sdist, args.cutlass) if args.sdist else None
    total = sum(p.stat().st_size for p in args.dest.rglob("*") if p.is_file())
    manifest = {"vllm": sources, "wheels": wheels, "csrc": csrc, "total_bytes": total}
    (args.dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"vllm {sources['version']}: {sources['files']} files ({sources['bytes'] / 1e6:.1f} MB) -> "
          f"{sources['tarball_bytes'] / 1e6:.1f} MB tarball; {len(wheels)} wheels; {total / 2**20:.1f} MiB in {args.dest}")
    if total > 48 << 20:
        print(f"error: {total / 2**20:.1f} MiB leaves too little of the 64 MiB a device call carries", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
