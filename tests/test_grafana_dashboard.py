"""k8s/monitoring/grafana-dashboard.json: every field is one Grafana's schema knows (checked with
grafana-foundation-sdk, whose models Grafana generates from its own dashboard and panel schemas),
and every query asks for metrics the scheduler documents (docs/metrics.md)."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "k8s" / "monitoring" / "grafana-dashboard.json"
PANEL_MODULES = {"timeseries": "timeseries", "state-timeline": "statetimeline", "stat": "stat"}

sdk = pytest.importorskip("grafana_foundation_sdk.models.dashboard")


def plain(value):
    """A model's to_json() output down to JSON values (enums and nested models included)."""
    return json.loads(json.dumps(value, default=lambda o: o.to_json() if hasattr(o, "to_json") else o.value))


def unknown_fields(original, parsed, path: str = "") -> list[str]:
    """Paths of fields in `original` that the schema model did not keep."""
    if isinstance(original, dict) and isinstance(parsed, dict):
        found = []
        for key, value in original.items():
            if key not in parsed:
                found.append(f"{path}/{key}")
            else:
                found += unknown_fields(value, parsed[key], f"{path}/{key}")
        return found
    if isinstance(original, list) and isinstance(parsed, list):
        return [missing for index, (a, b) in enumerate(zip(original, parsed))
                for missing in unknown_fields(a, b, f"{path}[{index}]")]
    return []


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_has_only_fields_of_grafanas_dashboard_schema(dashboard):
    parsed = plain(sdk.Dashboard.from_json(dashboard).to_json())
    assert unknown_fields(dashboard, parsed) == []


@pytest.mark.parametrize("index", range(18))
def test_panel_options_and_field_config_belong_to_the_panel_type(dashboard, index):
    panel = dashboard["panels"][index]
    module = importlib.import_module(f"grafana_foundation_sdk.models.{PANEL_MODULES[panel['type']]}")
    options = plain(module.Options.from_json(panel["options"]).to_json())
    assert unknown_fields(panel["options"], options) == []
    custom = panel["fieldConfig"]["defaults"].get("custom")
    if custom is not None:
        assert unknown_fields(custom, plain(module.FieldConfig.from_json(custom).to_json())) == []


def test_every_panel_is_checked_and_ids_are_unique(dashboard):
    panels = dashboard["panels"]
    assert len(panels) == 18
    assert len({panel["id"] for panel in panels}) == len(panels)


def test_queries_use_documented_metrics_and_show_who_holds_waits_memory_and_handoffs(dashboard):
    documented = set(re.findall(r"^\| `(nvshare_[a-z_]+)`", (REPO / "docs" / "metrics.md").read_text(), re.MULTILINE))
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b(nvshare_[a-z_]+)", target["expr"]):
                base = re.sub(r"_(bucket|sum|count)$", "", name)
                assert name in documented or base in documented, f"{panel['title']}: {name} is not a documented metric"
                used.add(base)
    assert {"nvshare_client_holding", "nvshare_device_waiters", "nvshare_client_wait_seconds",
            "nvshare_client_memory_used_bytes", "nvshare_device_handoffs_total",
            "nvshare_scheduler_handoff_seconds", "nvshare_client_held_seconds_total",
            "nvshare_client_waited_seconds_total", "nvshare_device_swap_requested_bytes_total",
            "nvshare_client_memory_resident_bytes", "nvshare_client_memory_swapped_bytes",
            "nvshare_admission_reserved_bytes", "nvshare_client_admission_wait_seconds",
            "nvshare_client_weight", "nvshare_client_priority"} <= used


def test_per_client_panels_tell_users_apart(dashboard):
    """Outside Kubernetes every client has pod="": a panel by pod alone would add all users up."""
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            if re.search(r"\bby \([^)]*\bpod\b", target["expr"]):
                assert re.search(r"\bby \([^)]*\buser\b", target["expr"]), (panel["title"], target["expr"])
