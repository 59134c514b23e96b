"""The package's shape holds: imports run one way, down the layers; the
library (`hostmem`, `hicache_cp`) never imports the harness (`hicache_harness`)
or a plug-in; the plug-ins use the library only through its public API; no
library module outgrows ~600 lines.

The layers, bottom to top (a module may import only its own layer or lower
ones; docs/architecture.md draws the same picture):
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hostmem", "hicache_cp", "hicache_harness")

LAYERS: list[tuple[str, ...]] = [
    ("hostmem", "hicache_cp._hashes"),
    ("hicache_cp.errors", "hicache_cp.layout", "hicache_cp.keys", "hicache_cp.checksum", "hicache_cp.tables",
     "hicache_cp.cp", "hicache_cp.presets"),
    ("hicache_cp.radix", "hicache_cp.allocator", "hicache_cp.pools", "hicache_cp.metrics", "hicache_cp.node"),
    ("hicache_cp.io",),
    ("hicache_cp.ops", "hicache_cp.policy"),
    ("hicache_cp.config", "hicache_cp.l3", "hicache_cp.match", "hicache_cp.events"),
    ("hicache_cp.cache",),
    ("hicache_cp", "hicache_cp.prometheus", "hicache_cp.pd"),
    ("hicache_cp.integrations",),
    ("hicache_harness",),
]
MAX_LIBRARY_LINES = 600


def _modules() -> dict[str, Path]:
    """Every module by its dotted name: Python sources, and C sources (compiled modules, setup.py)."""
    out = {}
    for pkg in PACKAGES:
        for path in [*(ROOT / pkg).rglob("*.py"), *(ROOT / pkg).rglob("*.c")]:
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules imported anywhere in the file (top level or in functions)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    if path.suffix == ".c":  # a compiled module imports no project module
        return out
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            candidates = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for c in candidates:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name:
                out.add(c)
                break
    return out


def _layer(name: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = i, prefix.count(".")
    assert best is not None, f"{name} is in no layer: add it to LAYERS"
    return best


MODULES = _modules()
GRAPH = {name: _imports(name, path, set(MODULES)) for name, path in MODULES.items()}


def test_no_import_goes_up_a_layer() -> None:
    upward = [
        f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
        for a, deps in GRAPH.items()
        for b in deps
        if _layer(b) > _layer(a)
    ]
    assert not upward, "\n".join(sorted(upward))


def _library(name: str) -> bool:
    return name.split(".")[0] in ("hostmem", "hicache_cp") and not name.startswith("hicache_cp.integrations")


def test_the_library_never_imports_the_harness_or_a_plugin() -> None:
    bad = [f"{a} imports {b}" for a, deps in GRAPH.items() if _library(a)
           for b in deps if b.startswith(("hicache_harness", "hicache_cp.integrations"))]  # fmt: skip
    assert not bad, bad


def _plugin_reaches_inside(name: str, dep: str) -> bool:
    """A plug-in (`hicache_cp.integrations.<engine>...`) may import the public API
    (`hicache_cp`, its `__init__`) and its own engine's folder, nothing else of the project."""
    own = ".".join(name.split(".")[:3])
    return dep != "hicache_cp" and dep != own and not dep.startswith(own + ".")


def test_plugins_import_only_the_public_api() -> None:
    plugins = [n for n in GRAPH if n.startswith("hicache_cp.integrations.")]
    assert len(plugins) > 10, plugins  # both engines' folders are seen
    bad = [f"{a} imports {b}" for a in plugins for b in GRAPH[a] if _plugin_reaches_inside(a, b)]
    assert not bad, "export what a plug-in needs from hicache_cp/__init__.py:\n" + "\n".join(sorted(bad))


def test_the_plugin_check_sees_an_internal_import() -> None:
    assert _plugin_reaches_inside("hicache_cp.integrations.vllm.worker", "hicache_cp.io.base")
    assert _plugin_reaches_inside("hicache_cp.integrations.vllm.worker", "hicache_cp.integrations.sglang.pools")
    assert _plugin_reaches_inside("hicache_cp.integrations.sglang", "hostmem.arena")
    assert not _plugin_reaches_inside("hicache_cp.integrations.vllm.worker", "hicache_cp")
    assert not _plugin_reaches_inside("hicache_cp.integrations.vllm.worker", "hicache_cp.integrations.vllm.plan")
    assert not _plugin_reaches_inside("hicache_cp.integrations.sglang.pools", "hicache_cp.integrations.sglang")


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(GRAPH[n]):
            if state.get(m) == 1:
                cycle = stack[stack.index(m):] + [m]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(GRAPH):
        if n not in state:
            visit(n)


def test_no_cycle_between_packages() -> None:
    """Subpackages (hicache_cp.cache, .l3, .io, ...) form a DAG too, not only modules."""

    def package(name: str) -> str:
        return ".".join(name.split(".")[:2])

    edges: dict[str, set[str]] = {}
    for a, deps in GRAPH.items():
        for b in deps:
            if package(a) != package(b):
                edges.setdefault(package(a), set()).add(package(b))
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        state[n] = 1
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                pytest.fail("package cycle: " + " -> ".join([*path, n, m]))
            if m not in state:
                visit(m, [*path, n])
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [])


def test_library_modules_stay_small() -> None:
    big = {n: len(p.read_text().splitlines()) for n, p in MODULES.items() if n.split(".")[0] in ("hostmem", "hicache_cp")}
    over = {n: lines for n, lines in big.items() if lines > MAX_LIBRARY_LINES}
    assert not over, f"library modules over {MAX_LIBRARY_LINES} lines: {over}"


def test_the_public_api_is_exported() -> None:
    import hicache_cp

    for name in ("HiCache", "Config", "Model", "Part", "MatchResult", "LoadOp", "BackupOp", "ConsistencyError",
                 "HiCacheError", "ConfigError"):
        assert name in hicache_cp.__all__ and hasattr(hicache_cp, name), name
    missing = [name for name in hicache_cp.__all__ if not hasattr(hicache_cp, name)]
    assert not missing, f"hicache_cp.__all__ names what it cannot import: {missing}"
