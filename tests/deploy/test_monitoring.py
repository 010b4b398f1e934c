"""The Grafana dashboard and the Prometheus alert rules: well formed, checked and unit-tested by
promtool, and naming only metrics (and labels) a real sidecar exports after a transfer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import DEPLOY, Scrape, TransferScrapes, run
from tests.deploy.promql import grafana_to_promql, names

DASHBOARD = DEPLOY / "grafana" / "kvsidecar.json"
RULES = DEPLOY / "prometheus" / "rules.yaml"
RULES_TEST = DEPLOY / "prometheus" / "rules_test.yaml"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Labels Prometheus attaches to every scraped series (the target's); `le` is in the scrape.
TARGET_LABELS = frozenset({"job", "instance"})

# Panels the dashboard must have (by title) and a metric each must query.
PANELS = {
    "Transfer rate": "rate(kvsidecar_read_bytes_total",
    "Read latency": "histogram_quantile(0.99, sum by (le) (rate(kvsidecar_read_duration_seconds_bucket",
    "Read failures by reason": "sum by (reason) (rate(kvsidecar_reads_failed_total",
    "Peers by state": "sum by (state) (kvsidecar_peers",
    "Holds": "kvsidecar_holds_active",
    "Leases expired": "kvsidecar_leases_expired_total",
    "Loop lag": "kvsidecar_poll_loop_lag_seconds_bucket",
    "CPU": "rate(process_cpu_seconds_total",
    "Session commands in flight": "kvsidecar_session_commands_in_flight",
    "Read phases (p99)": "sum by (phase, le) (rate(kvsidecar_read_phase_seconds_bucket",
    "No P/D transfer": "kvsidecar_no_transfer_windows_total",
    "Peer control round trip": "kvsidecar_peer_control_rtt_seconds",
    "Peer transfer rate": "kvsidecar_peer_transfer_bytes_per_second",
}
# Alerts the rules must have, and a metric each must use.
ALERTS = {
    "KvsidecarReadFailuresRising": "kvsidecar_reads_failed_total",
    "KvsidecarPeerQuarantined": 'kvsidecar_peers{state="quarantined"}',
    "KvsidecarLeasesExpiring": "kvsidecar_leases_expired_total",
    "KvsidecarNotReady": "kvsidecar_ready == 0",
    "KvsidecarLoopLagHigh": "kvsidecar_poll_loop_lag_seconds_bucket",
    "KvsidecarNoTransfers": "kvsidecar_no_transfer_windows_total",
    "KvsidecarCorruptRead": 'kvsidecar_reads_failed_total{reason="corrupt"}',
}


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _dashboard_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """Where -> query, for every panel target and every query variable."""
    queries = {}
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            queries[f"panel {panel['id']} ({panel['title']}) {target['refId']}"] = target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            queries[f"variable {var['name']}"] = (
                query["query"] if isinstance(query, dict) else query
            )
    return queries


def _rule_queries(path: Path = RULES) -> dict[str, str]:
    rules = yaml.safe_load(path.read_text())
    return {
        rule.get("alert") or rule["record"]: rule["expr"]
        for group in rules["groups"]
        for rule in group["rules"]
    }


def test_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource_variable() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "kvsidecar"
    assert dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int)
    assert dashboard["schemaVersion"] >= 36  # datasource references as {type, uid} objects
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == DATASOURCE
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    boxes = []
    for panel in panels:
        g = panel["gridPos"]
        assert g["w"] > 0, panel["title"]
        assert g["h"] > 0, panel["title"]
        assert 0 <= g["x"] <= g["x"] + g["w"] <= 24, panel["title"]
        boxes.append((panel["title"], g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"]))
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        targets = panel["targets"]
        assert targets, panel["title"]
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for target in targets:
            assert target["datasource"] == DATASOURCE, panel["title"]
            assert target["expr"].strip(), panel["title"]
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
    for i, (a, ax0, ay0, ax1, ay1) in enumerate(boxes):
        for b, bx0, by0, bx1, by1 in boxes[i + 1 :]:
            assert ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0, f"{a} overlaps {b}"


def test_dashboard_has_the_operational_panels() -> None:
    by_title = {p["title"]: p for p in _panels(_dashboard())}
    for title, needle in PANELS.items():
        assert title in by_title, f"no panel {title!r}"
        exprs = " ".join(t["expr"] for t in by_title[title]["targets"])
        assert needle in exprs, (title, exprs)


def test_rules_have_the_operational_alerts() -> None:
    queries = _rule_queries()
    for alert, needle in ALERTS.items():
        assert alert in queries, f"no alert {alert}"
        assert needle in queries[alert], (alert, queries[alert])


def _check_rules(promtool: str, path: Path) -> tuple[int, str]:
    result = run([promtool, "check", "rules", str(path)])
    return result.returncode, (result.stdout + result.stderr).strip()


def test_promtool_checks_the_rules(promtool: str) -> None:
    rc, output = _check_rules(promtool, RULES)
    assert rc == 0, output
    assert f"SUCCESS: {len(_rule_queries())} rules found" in output


def test_promtool_unit_tests_of_the_rules_pass(promtool: str) -> None:
    """rules_test.yaml: every alert fires on a sidecar in trouble, not on a healthy one."""
    result = run([promtool, "test", "rules", str(RULES_TEST)])
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in test["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert tested == set(_rule_queries()), "every alert needs a firing case in rules_test.yaml"


def test_promtool_rejects_broken_rules(promtool: str, tmp_path: Path) -> None:
    """The checks above can fail: a syntax error, and an alert that no longer fires."""
    bad_syntax = tmp_path / "syntax.yaml"
    bad_syntax.write_text(RULES.read_text().replace("(kvsidecar_peers{", "(kvsidecar_peers{{", 1))
    rc, output = _check_rules(promtool, bad_syntax)
    assert rc != 0
    assert "KvsidecarPeerQuarantined" in output or "parse error" in output, output
    # The unit tests fail when a threshold is raised past the synthetic traffic's failure ratio.
    rules_dir = tmp_path / "raised"
    rules_dir.mkdir()
    raised = RULES.read_text().replace("    > 0.05\n", "    > 0.5\n", 1)
    assert raised != RULES.read_text()
    (rules_dir / "rules.yaml").write_text(raised)
    shutil.copy(RULES_TEST, rules_dir / "rules_test.yaml")
    result = run([promtool, "test", "rules", str(rules_dir / "rules_test.yaml")])
    assert result.returncode != 0
    assert "KvsidecarReadFailuresRising" in result.stdout + result.stderr


def _dashboard_as_rules(dashboard: dict[str, Any], path: Path) -> int:
    """Every dashboard query as a recording rule (variables substituted), so that promtool parses
    it as PromQL; returns how many."""
    rules = [
        {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(query)}
        for i, query in enumerate(_dashboard_queries(dashboard).values())
    ]
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return len(rules)


def test_promtool_parses_every_dashboard_query(promtool: str, tmp_path: Path) -> None:
    n = _dashboard_as_rules(_dashboard(), tmp_path / "dashboard.yaml")
    rc, output = _check_rules(promtool, tmp_path / "dashboard.yaml")
    assert rc == 0, output
    assert f"SUCCESS: {n} rules found" in output
    # ... and a query that is not PromQL is caught.
    broken = _dashboard()
    broken["panels"][1]["targets"][0]["expr"] = "sum(rate(kvsidecar_read_bytes_total[5m])"
    _dashboard_as_rules(broken, tmp_path / "broken.yaml")
    assert _check_rules(promtool, tmp_path / "broken.yaml")[0] != 0


def _unknown(queries: dict[str, str], scrapes: list[Scrape]) -> list[str]:
    """Queries naming a series or a label that no scrape carries (target labels aside)."""
    series = {s.name for scrape in scrapes for s in scrape.samples}
    labels = {label for scrape in scrapes for s in scrape.samples for label in s.labels}
    problems = []
    for where, query in queries.items():
        used = names(grafana_to_promql(query))
        if not used.metrics:
            problems.append(f"{where}: names no metric: {query}")
        problems.extend(f"{where}: no series {m}" for m in sorted(used.metrics - series))
        problems.extend(
            f"{where}: no label {label}" for label in sorted(used.labels - labels - TARGET_LABELS)
        )
    return problems


def test_every_query_names_series_a_real_sidecar_exports(
    transfer_scrapes: TransferScrapes,
) -> None:
    """Names are compared with the sample names of the scrapes as exported (`_total`, `_bucket`,
    `_sum`, `_count` included), so a counter queried without `_total` or a histogram without
    `_bucket` is caught too."""
    scrapes = [transfer_scrapes.consumer, transfer_scrapes.producer]
    queries = {**_dashboard_queries(_dashboard()), **_rule_queries()}
    assert len(queries) > 30
    assert _unknown(queries, scrapes) == []


def test_the_name_check_catches_what_a_sidecar_does_not_export(
    transfer_scrapes: TransferScrapes,
) -> None:
    scrapes = [transfer_scrapes.consumer]
    queries = {
        "typo": "rate(kvsidecar_reads_faild_total[5m])",
        "no suffix": "rate(kvsidecar_read_bytes[5m])",
        "histogram without _bucket": "histogram_quantile(0.9, rate(kvsidecar_read_duration_seconds[5m]))",
        "label": "sum by (reasons) (kvsidecar_reads_failed_total)",
        "nothing": "vector(1)",
        "fine": 'sum by (reason, instance) (rate(kvsidecar_reads_failed_total{job="x"}[5m]))',
    }
    assert _unknown(queries, scrapes) == [
        "typo: no series kvsidecar_reads_faild_total",
        "no suffix: no series kvsidecar_read_bytes",
        "histogram without _bucket: no series kvsidecar_read_duration_seconds",
        "label: no label reasons",
        "nothing: names no metric: vector(1)",
    ]


@pytest.mark.parametrize(
    ("expr", "metrics", "labels"),
    [
        (
            'sum by (job, le) (rate(a_bucket{x="1", y=~"$instance"}[$__rate_interval])) > 0.05',
            {"a_bucket"},
            {"job", "le", "x", "y"},
        ),
        (
            "max_over_time(rate(a_total[5m])[30m:1m]) offset 1h"
            " / on (instance) group_left (version) b_info * 1e-3",
            {"a_total", "b_info"},
            {"instance", "version"},
        ),
        ("sum(c) without (pod) and bool d unless e", {"c", "d", "e"}, {"pod"}),
        (
            'label_values(kvsidecar_build_info{job=~"$job"}, instance)',
            {"kvsidecar_build_info"},
            {"job"},
        ),
        ("label_values(instance)", set(), set()),
    ],
)
def test_promql_names(expr: str, metrics: set[str], labels: set[str]) -> None:
    used = names(grafana_to_promql(expr))
    assert used.metrics == metrics
    assert used.labels == labels
