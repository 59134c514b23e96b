"""The harness's SGLang import (`hicache_harness.sglang.env.import_sglang`) where torchvision
imports, as on the GPU image (torchvision 0.26), and where it does not, as here.

The GPU image cannot be had on CPU, so a real-looking torchvision stands in for
it: a package tree with the modules transformers and SGLang's configs import
(`transforms`, `transforms.functional`, `transforms.v2`, `io`) and an installed
distribution's metadata, so transformers' probe finds it as it finds the real
one. Each case runs in a fresh interpreter (SGLang's configs import once per
process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="sglang not installed (scripts/install_sglang.sh)")

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]

_ANY = '''

def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def double(*args, **kwargs):
        raise NotImplementedError(f"{__name__}.{name}: a test double")

    return double
'''
_MODES = "NEAREST NEAREST_EXACT BILINEAR BICUBIC BOX HAMMING LANCZOS".split()
_TREE = {
    "torchvision/__init__.py": '__version__ = "0.26.0"\nREAL_LOOKING = True\nfrom . import io, transforms  # noqa\n',
    "torchvision/transforms/__init__.py": "import enum\n\nInterpolationMode = enum.Enum('InterpolationMode', "
    + repr({m: m.lower() for m in _MODES}) + ")\nfrom . import functional  # noqa\n",
    "torchvision/transforms/functional.py": "",
    "torchvision/transforms/v2/__init__.py": "from . import functional  # noqa\n",
    "torchvision/transforms/v2/functional.py": "",
    "torchvision/io.py": "",
}


def real_looking_torchvision(root: Path, *, broken: bool = False) -> Path:
    """A torchvision package tree under `root` with its distribution's metadata (`broken`:
    its import raises, as a CUDA build's does beside a CPU torch)."""
    for rel, text in _TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + _ANY)
    if broken:
        (root / "torchvision/__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    info = root / "torchvision-0.26.0.dist-info"
    info.mkdir(exist_ok=True)
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.26.0\n")
    return root


def _run(args: list[str], extra_path: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    path = [str(REPO), str(extra_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_torchvision_that_imports_is_used_not_replaced(tmp_path: Path) -> None:
    """With torchvision importable, SGLang's configs import with it, and transformers (whose
    probe finds it installed) imports `torchvision.transforms.v2` from it: a stand-in in its
    place would lack that module and fail the import."""
    vision = real_looking_torchvision(tmp_path / "site")
    script = (
        "import sys\n"
        "from hicache_harness.sglang.env import import_sglang\n"
        "import_sglang()\n"
        "import torchvision, torchvision.transforms.v2\n"
        "from transformers.utils import import_utils\n"
        "from transformers import AutoProcessor\n"
        "assert 'sglang.srt.configs' in sys.modules\n"
        "print('real-looking' if getattr(torchvision, 'REAL_LOOKING', False) else 'stand-in',"
        " import_utils.is_torchvision_available())\n"
    )
    out = _run(["-c", script], vision)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["real-looking", "True"], out.stdout


def test_an_installed_torchvision_that_does_not_import_is_named(tmp_path: Path) -> None:
    """Installed but broken (a CUDA build beside a CPU torch): transformers finds it installed
    and would import it for SGLang's configs whatever stands in, so the import fails naming
    torchvision and the reason, instead of transformers' "Could not import module"."""
    vision = real_looking_torchvision(tmp_path / "site", broken=True)
    script = "from hicache_harness.sglang.env import import_sglang\nimport_sglang()\n"
    out = _run(["-c", script], vision)
    assert out.returncode == 1
    assert "ImportError: torchvision is installed but does not import (RuntimeError: operator torchvision::nms" in out.stderr


def test_the_sglang_gpu_tests_collect_beside_a_torchvision_that_imports(tmp_path: Path) -> None:
    """What the device runs (`pytest -m gpu` over the SGLang test files) collects with a
    torchvision that imports, and selects the GPU tests of each file that has some."""
    vision = real_looking_torchvision(tmp_path / "site")
    files = ["tests/test_sglang_radix.py", "tests/test_sglang_blockers.py", "tests/test_sglang_race.py",
             "tests/test_events_sglang.py"]  # fmt: skip
    out = _run(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *files], vision)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    assert collected == set(files) - {"tests/test_events_sglang.py"}, out.stdout  # it has no GPU test
