"""docs/grafana/hicache-cp.json names only metrics the exporter serves, under every naming."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hicache_cp.prometheus import FAMILIES, NAMINGS, metric_names

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "hicache-cp.json"


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _expressions(dash: dict) -> list[str]:
    """Every PromQL expression: the panels' targets and the template variables' queries."""
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        q = var.get("query")
        if isinstance(q, dict):
            exprs.append(q["query"])
    return exprs


def _prefix_options(dash: dict) -> list[str]:
    (var,) = [v for v in dash["templating"]["list"] if v["name"] == "prefix"]
    return [o["value"] for o in var["options"]]


def test_the_prefix_variable_offers_every_naming() -> None:
    assert sorted(_prefix_options(_dashboard())) == sorted(NAMINGS.values())


def test_every_expression_names_only_exported_metrics() -> None:
    dash = _dashboard()
    exprs = _expressions(dash)
    assert exprs and all("${prefix}" in e for e in exprs), "an expression names a metric without ${prefix}"
    for naming, prefix in NAMINGS.items():
        exported = set(metric_names(naming))
        for expr in exprs:
            text = expr.replace("${prefix}", prefix)
            names = re.findall(r"(?<![A-Za-z0-9_:])" + re.escape(prefix) + r"[A-Za-z0-9_]+", text)
            assert names, f"{expr!r} names no metric"
            unknown = sorted(set(names) - exported)
            assert not unknown, f"{naming}: {expr!r} names {unknown}, which the exporter does not serve"


def test_every_family_has_a_panel() -> None:
    used = " ".join(_expressions(_dashboard()))
    missing = [name for name in FAMILIES if "${prefix}" + name not in used]
    assert not missing, f"families without a panel: {missing}"
