"""Pack vLLM 0.33.0's Python sources and the packages its imports need, for the device machine.

    .venv/bin/python tools/vllm_pack.py [--dest .vllm]      # here, before the device call
    then the device call carries `.vllm` and runs tools/device_vllm.sh

The vLLM wheel cannot be installed on the device image: it pins torch 2.14
(the image has 2.11) and is 336 MB, most of it compiled code that the
connector's tests never run. This packs, from the vLLM installed in this
venv (scripts/install_vllm.sh):

    .vllm/vllm-src.tar.gz   vllm/ without compiled parts: every *.so, vllm-rs/ (Rust
                            front end), third_party/fmha_sm100 and third_party/deep_gemm
                            (CUDA sources and cubins), C/C++/CUDA headers and sources,
                            __pycache__; plus vllm's dist-info (metadata lookups), plus
                            the shims of tools/vllm_shims/ (see that folder's README)
    .vllm/whl/*.whl         wheels for Python 3.12 on manylinux x86-64 of the
                            distributions vLLM's imports need that the device image
                            lacks (KINDS.md's package list), at the versions installed here
    .vllm/manifest.json     what was packed, from where, and the sizes

Run where pip reaches the package index. Idempotent: wheels already in
.vllm/whl are kept. The total must stay well inside the device call's 64 MiB.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import json
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from device_pack import add_tree, pip_download  # noqa: E402
SHIMS = REPO / "tools" / "vllm_shims"

#: Distributions that vLLM 0.33.0's imports load (in these tests: the scheduler,
#: the KV-connector API, config, the OffloadingConnector) and that the device image
#: does not have. Found by importing under the tests here and subtracting the
#: image's package list (/work/.library/device/KINDS.md, "Python packages already there").
CARRY = [
    "annotated-types", "apache-tvm-ffi", "cachetools", "cbor2", "fastapi", "httpcore2", "httpx2",
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
    args = ap.parse_args()
    args.dest.mkdir(parents=True, exist_ok=True)
    sources = pack_sources(args.dest)
    wheels = download_wheels(args.dest)
    total = sum(p.stat().st_size for p in args.dest.rglob("*") if p.is_file())
    manifest = {"vllm": sources, "wheels": wheels, "total_bytes": total}
    (args.dest / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"vllm {sources['version']}: {sources['files']} files ({sources['bytes'] / 1e6:.1f} MB) -> "
          f"{sources['tarball_bytes'] / 1e6:.1f} MB tarball; {len(wheels)} wheels; {total / 2**20:.1f} MiB in {args.dest}")
    if total > 48 << 20:
        print(f"error: {total / 2**20:.1f} MiB leaves too little of the 64 MiB a device call carries", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
