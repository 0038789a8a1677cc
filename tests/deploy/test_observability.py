"""Checks of the observability files: the Grafana dashboard (deploy/grafana/oomcast.json), the
Prometheus alerting rules (deploy/prometheus/oomcast-rules.yaml and its Prometheus Operator
twin in deploy/kubernetes-extras/), and the scrape configuration they rely on.

Every PromQL expression, in a panel, a template variable or a rule, must name only metrics
that oomcast really exports, and only labels those metrics carry. The exported names are not
a list kept here: they are read from a live ``Metrics()`` registry of the service and from
the ``/metrics`` text of a node agent built with its real sources (cgroup with PSI, NVML
through the fake binding, the control listener). Where ``promtool`` is installed (Debian
package ``prometheus``) it checks the rules, parses every dashboard query, and runs unit
tests of the alerts on synthetic series: each alert fires when it should, after its
``for:``, and none fires on a healthy fleet.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from support import v2_files, write_files

from oomcast.bench.fake_nvml import GIB, FakeGpu, FakeNvml, NVMLError_Unknown
from oomcast.collectors.actiontypes import ActionResult
from oomcast.collectors.agent import NodeAgent
from oomcast.collectors.control import ControlListener
from oomcast.collectors.metrics import agent_samples, render
from oomcast.collectors.nvml import Nvml
from oomcast.collectors.procinfo import ProcResolver
from oomcast.collectors.publisher import StreamPublisher
from oomcast.collectors.sources.cgroup import CgroupSource
from oomcast.collectors.sources.nvml import NvmlSource
from oomcast.model.wire import Keys
from oomcast.service.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "oomcast.json"
RULES = ROOT / "deploy" / "prometheus" / "oomcast-rules.yaml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus-example.yml"
EXTRAS = ROOT / "deploy" / "kubernetes-extras"
OPERATOR_RULE = EXTRAS / "prometheusrule.yaml"
PODMONITORS = EXTRAS / "podmonitors.yaml"
KUBE = ROOT / "deploy" / "kubernetes"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ROWS = ["Fleet risk", "Alerts, actions and deliveries", "Ingest health", "Agent health"]
# Grafana's own variables, substituted by Grafana itself (with the value promtool gets below)
GRAFANA_VARS = {"__rate_interval": "5m", "__range": "1h", "__interval": "1m"}
SEVERITIES = {"critical", "warning"}
DURATION = re.compile(r"^(\d+[smhdw])+$")
# the labels the Prometheus Operator puts on every target of a PodMonitor
OPERATOR_TARGET_LABELS = {"namespace", "pod", "container"}

# =============================================================================================
# What oomcast exports: sample name -> the label names its series carry (None: not known
# before the series exists, as an Info's, which takes its labels when it is set)
# =============================================================================================
Exported = dict[str, frozenset[str] | None]

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def service_exports() -> Exported:
    """Every sample name of the service's registry, with its labels. ``collect()`` names a
    family even before any labelled child exists; the label names come from the metric
    objects themselves (prometheus_client keeps them in ``_labelnames``)."""
    metrics = Metrics()
    labels: dict[str, tuple[str, ...]] = {}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            labels[str(value._name)] = tuple(value._labelnames)
    out: Exported = {}
    for family in metrics.registry.collect():
        if family.type not in SUFFIXES:
            raise AssertionError(f"metric type {family.type!r} of {family.name} not handled")
        for suffix in SUFFIXES[family.type]:
            names: frozenset[str] | None = frozenset(labels.get(family.name, ()))
            if family.type == "info":
                names = None
            elif suffix == "_bucket":
                names = frozenset({*labels.get(family.name, ()), "le"})
            out[family.name + suffix] = names
    return out


class _Executor:
    def __call__(self, command: Any, candidates: Any) -> ActionResult:
        raise AssertionError("no command is run here")


def agent_exports(tmp: Path) -> Exported:
    """The sample names of a node agent's /metrics, with their labels: an agent with the
    sources of a GPU node (NVML, one call of which fails; a cgroup under memory pressure)
    and a control listener, each polled once so that their labelled series exist."""
    root = tmp / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    psi = "some avg10=2.25 avg60=0 avg300=0 total=10\nfull avg10=1.00 avg60=0 avg300=0 total=5\n"
    write_files(root / "job", v2_files() | {"cgroup.procs": "1", "memory.pressure": psi})
    (tmp / "proc").mkdir()
    cgroup = CgroupSource("n1", root, interval_s=1.0)
    fake = FakeNvml([FakeGpu(processes=[(1001, GIB)]), FakeGpu()])
    fake.fail("nvmlDeviceGetMemoryInfo", NVMLError_Unknown, device=1)
    nvml = NvmlSource("n1", Nvml(fake), ProcResolver(tmp / "proc"))
    cgroup.poll(1_000.0)
    nvml.poll(1_000.0)
    # never connected: nothing here talks to Redis
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.1)
    keys = Keys("observability")
    agent = NodeAgent([cgroup, nvml], StreamPublisher(client), keys, interval_s=1.0)
    listener = ControlListener(
        client, keys, "n1", "a-control-secret", {"checkpoint": _Executor()}, lambda c: []
    )
    text = render(agent_samples(agent, [listener]))
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(labels) for name, labels in found.items()}


@functools.cache
def target_labels() -> frozenset[str]:
    """Labels every scraped series carries: job and instance, plus those the shipped scrape
    configuration and PodMonitors add."""
    out = {"job", "instance"} | OPERATOR_TARGET_LABELS
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for job in config["scrape_configs"]:
        out.update(r["target_label"] for r in job.get("relabel_configs", []) if "target_label" in r)
    for doc in yaml.safe_load_all(PODMONITORS.read_text()):
        for endpoint in doc["spec"]["podMetricsEndpoints"]:
            out.update(r["targetLabel"] for r in endpoint.get("relabelings", []))
    return frozenset(out)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    service, agent = service_exports(), agent_exports(tmp_path_factory.mktemp("agent"))
    clash = set(service) & set(agent)
    assert not clash, f"service and agent export the same names: {sorted(clash)}"
    return {**service, **agent, "up": frozenset()}


# =============================================================================================
# Reading PromQL: which metrics and labels an expression names
# =============================================================================================
_FUNCTION_NAMES = """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
    days_in_month deg delta deriv exp floor histogram_avg histogram_count histogram_fraction
    histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta
    increase irate label_join label_replace last_over_time ln log10 log2 mad_over_time
    max_over_time min_over_time minute month pi predict_linear present_over_time
    quantile_over_time rad rate resets round scalar sgn sin sinh sort sort_desc sqrt
    stddev_over_time stdvar_over_time sum_over_time tan tanh time timestamp vector year
    sum min max avg group stddev stdvar count count_values bottomk topk quantile"""
FUNCTIONS = set(_FUNCTION_NAMES.split())
KEYWORDS = {"and", "or", "unless", "bool", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*\"\"\s*$")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_OFFSET = re.compile(r"\boffset\s+-?\s*[\w.]+|@\s*(?:start\(\)|end\(\)|[\d.]+)")
_NUMBER = re.compile(r"(?<![\w:.])(?:0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)")
_IDENT = re.compile(r"[A-Za-z_:][\w:]*")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?:(.*),)?\s*([A-Za-z_]\w*)\s*\)\s*$", re.S)


@dataclass
class Query:
    """What one PromQL expression names."""

    metrics: set[str] = field(default_factory=set)
    selectors: list[tuple[str, set[str]]] = field(default_factory=list)  # (metric, labels)
    grouping: set[str] = field(default_factory=set)  # labels of by/without/on/ignoring/group_*
    variables: set[str] = field(default_factory=set)  # Grafana variables used


def read_promql(expr: str) -> Query:
    """The metrics, label matchers and grouping labels of an expression (Grafana variables
    allowed). Raises ValueError on what it cannot read, naming the part."""
    q = Query(variables={a or b for a, b in _VAR.findall(expr)})
    text = _STRING.sub('""', expr)  # label values, regexes, label_replace arguments
    text = _VAR.sub(" 1 ", text)
    if "$" in text or "{{" in text:
        raise ValueError(f"unreadable variable in {expr!r}")

    def selector(m: re.Match[str]) -> str:
        name, body = m.group(1), m.group(2)
        labels = set()
        for part in filter(str.strip, body.split(",")):
            matcher = _MATCHER.match(part)
            if not matcher:
                raise ValueError(f"cannot read the label matcher {part.strip()!r} in {expr!r}")
            labels.add(matcher.group(1))
        if "__name__" in labels or not name:
            raise ValueError(f"name the metric before its braces, not by __name__: {expr!r}")
        q.selectors.append((name, labels))
        return f" {name} "

    text = _SELECTOR.sub(selector, text)
    text = _RANGE.sub(" ", text)
    for labels in _GROUPING.findall(text):
        q.grouping.update(part.strip() for part in labels.split(",") if part.strip())
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    if re.search(r"[{}\[\]]", text):
        raise ValueError(f"unbalanced braces or brackets in {expr!r}")
    for m in _IDENT.finditer(text):
        word = m.group(0)
        if re.match(r"\s*\(", text[m.end() :]):
            if word not in FUNCTIONS:
                raise ValueError(f"unknown PromQL function {word!r} in {expr!r}")
        elif word.lower() not in KEYWORDS:
            q.metrics.add(word)
    return q


def problems(expr: str, exported: Exported) -> list[str]:
    """What in an expression names something oomcast does not export (empty: nothing)."""
    q = read_promql(expr)
    out = []
    targets = target_labels()
    for name in sorted(q.metrics):
        if name not in exported:
            near = difflib.get_close_matches(name, exported, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            out.append(f"metric {name} is not exported{hint}")
    for name, labels in q.selectors:
        allowed = exported.get(name)
        if allowed is None:
            continue
        for label in sorted(labels - allowed - targets):
            out.append(f"{name} has no label {label!r} (it has {sorted(allowed)})")
    if out or any(exported.get(name) is None for name in q.metrics):
        return out  # labels unknown: an Info's, or those of a metric already reported
    carried = set(targets) | {"le"}
    for name in q.metrics:
        carried |= exported[name] or set()
    for label in sorted(q.grouping - carried):
        out.append(f"no metric of the expression has the label {label!r} it groups by")
    return out


# =============================================================================================
# The files
# =============================================================================================
def load_dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panels_of(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # the panels of a collapsed row


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in panels_of(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            m = _LABEL_VALUES.match(query)
            assert m, f"variable {var['name']}: only label_values(...) is read: {query!r}"
            if m.group(1):
                yield f"variable {var['name']}", m.group(1)


def variable_labels(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(variable, selector, label) of each label_values(selector, label) variable."""
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = _LABEL_VALUES.match(var["query"])
            assert m and m.group(1)
            yield var["name"], m.group(1), m.group(2)


def load_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


# =============================================================================================
# Reading PromQL is itself tested: a reader that missed names would pass anything
# =============================================================================================
@pytest.mark.parametrize(
    ("expr", "metrics", "grouping"),
    [
        ("up", {"up"}, set()),
        ('up{job="x", instance=~"a|b"} == 0', {"up"}, set()),
        (
            "histogram_quantile(0.99, sum by (instance, le) (rate(lat_bucket[$__rate_interval])))",
            {"lat_bucket"},
            {"instance", "le"},
        ),
        ('sum(rate(a_total{s="rate(b_total[5m])"}[5m])) by (s) > 0.5e3', {"a_total"}, {"s"}),
        (
            "a and on(instance) b unless ignoring(x) c or vector(0)",
            {"a", "b", "c"},
            {"instance", "x"},
        ),
        ('topk($topn, max without (kind) (psi{node=~"${node:regex}"}))', {"psi"}, {"kind"}),
        ("delta(owed[10m] offset 5m) > 0x10 and rate(x[1h:1m]) < bool 1", {"owed", "x"}, set()),
        ('label_replace(m, "dst", "$1", "src", "(.*)")', {"m"}, set()),
        ('absent(up{job="svc"}) * inf', {"up"}, set()),
    ],
)
def test_reading_promql(expr: str, metrics: set[str], grouping: set[str]) -> None:
    q = read_promql(expr)
    assert q.metrics == metrics
    assert q.grouping == grouping


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("rte(a[5m])", "unknown PromQL function 'rte'"),
        ('{__name__="a"}', "not by __name__"),
        ("sum(a{job})", "cannot read the label matcher 'job'"),
        ("sum(a[5m)", "unbalanced"),
    ],
)
def test_unreadable_promql_is_refused_with_the_reason(expr: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        read_promql(expr)


def test_the_exported_names_come_from_the_real_registries(exported: Exported) -> None:
    # a counter is exported with _total, a histogram as its three series, and the agent's
    # labelled series are there with their labels
    assert exported["oomcast_samples_ingested_total"] == frozenset()
    assert exported["oomcast_deliveries_total"] == frozenset({"target", "result"})
    assert "le" in (exported["oomcast_forecast_latency_seconds_bucket"] or set())
    assert "oomcast_forecast_latency_seconds_count" in exported
    assert "oomcast_samples_ingested" not in exported
    assert exported["oomcast_agent_memory_pressure_avg10"] == frozenset({"device", "kind"})
    assert exported["oomcast_agent_nvml_errors_total"] == frozenset({"function", "error"})
    assert exported["oomcast_agent_control_refused_total"] == frozenset({"reason"})


# =============================================================================================
# The dashboard
# =============================================================================================
def test_dashboard_structure() -> None:
    d = load_dashboard()
    assert d["schemaVersion"] >= 39 and d["uid"] and d["title"]
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ROWS
    variables = {v["name"]: v for v in d["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    ids, boxes = set(), []
    in_row: dict[str, int] = {}
    row = ""
    for panel in panels_of(d):
        assert panel["id"] not in ids, f"panel id {panel['id']} twice"
        ids.add(panel["id"])
        box = panel["gridPos"]
        assert box["x"] + box["w"] <= 24, f"{panel['title']!r} is wider than the grid"
        boxes.append((panel["title"], box))
        if panel["type"] == "row":
            row = panel["title"]
            continue
        assert panel.get("description"), f"{panel['title']!r} has no description"
        in_row[row] = in_row.get(row, 0) + 1
        if panel["type"] == "text":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], f"{panel['title']!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), f"{panel['title']!r} repeats a refId"
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE and target["expr"].strip()
    assert all(in_row.get(r, 0) >= 4 for r in ROWS), in_row
    for i, (a, p) in enumerate(boxes):
        for b, q in boxes[i + 1 :]:
            overlap = (
                p["x"] < q["x"] + q["w"]
                and q["x"] < p["x"] + p["w"]
                and p["y"] < q["y"] + q["h"]
                and q["y"] < p["y"] + p["h"]
            )
            assert not overlap, f"panels {a!r} and {b!r} overlap"


def test_dashboard_names_no_datasource_of_its_own() -> None:
    """Every datasource reference is the variable (or Grafana's built-in annotations), so
    the board imports into any Grafana with any Prometheus."""

    def walk(node: Any, where: str) -> Iterator[tuple[str, Any]]:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "datasource":
                    yield where, v
                yield from walk(v, f"{where}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                yield from walk(v, f"{where}[{i}]")

    refs = list(walk(load_dashboard(), "$"))
    assert len(refs) > 40
    for where, ref in refs:
        builtin = ref == {"type": "grafana", "uid": "-- Grafana --"}
        assert ref == DATASOURCE or builtin, f"{where} names datasource {ref!r}"


def test_every_dashboard_variable_is_defined() -> None:
    d = load_dashboard()
    defined = {v["name"] for v in d["templating"]["list"]} | set(GRAFANA_VARS)
    text = json.dumps(d)
    used = {a or b for a, b in _VAR.findall(text)}
    assert used - defined == set(), f"variables used but not defined: {used - defined}"
    assert {"datasource", "node", "topn", "oomcast_url"} <= used


def test_every_dashboard_query_names_what_oomcast_exports(exported: Exported) -> None:
    d = load_dashboard()
    found = {where: problems(expr, exported) for where, expr in dashboard_queries(d)}
    assert len(found) > 50
    assert {w: p for w, p in found.items() if p} == {}
    for name, selector, label in variable_labels(d):
        metric = read_promql(selector).selectors[0][0] if "{" in selector else selector.strip()
        allowed = (exported.get(metric) or frozenset()) | target_labels()
        assert label in allowed, f"variable {name}: {metric} has no label {label!r}"


def test_a_misspelled_metric_or_label_in_a_copy_of_the_dashboard_is_caught(
    exported: Exported,
) -> None:
    d = copy.deepcopy(load_dashboard())
    panel = next(p for p in panels_of(d) if "Dead letters" in p["title"])
    good = panel["targets"][0]["expr"]
    assert "oomcast_samples_rejected_total" in good
    panel["targets"][0]["expr"] = good.replace("samples_rejected", "sample_rejected")
    found = [p for _, expr in dashboard_queries(d) for p in problems(expr, exported)]
    assert found == [
        "metric oomcast_sample_rejected_total is not exported"
        " (did you mean oomcast_samples_rejected_total?)"
    ]
    panel["targets"][0]["expr"] = good.replace("by (reason)", "by (reasons)")
    found = [p for _, expr in dashboard_queries(d) for p in problems(expr, exported)]
    assert found == ["no metric of the expression has the label 'reasons' it groups by"]
    panel["targets"][0]["expr"] = 'sum(oomcast_samples_rejected_total{code="schema"})'
    found = [p for _, expr in dashboard_queries(d) for p in problems(expr, exported)]
    assert len(found) == 1 and "has no label 'code'" in found[0]


# =============================================================================================
# The rules
# =============================================================================================
REQUIRED_ALERTS = {
    "OomcastServiceDown",  # service down
    "OomcastServiceAbsent",
    "OomcastRedisUnreachable",  # Redis unreachable: also what makes /readyz fail
    "OomcastReplicaWithoutPartitions",
    "OomcastIngestStalled",
    "OomcastIngestFallingBehind",
    "OomcastForecastLatencyHigh",  # lag
    "OomcastDeadLettersRising",
    "OomcastDeliveriesFailing",
    "OomcastDeliveryBacklogGrowing",
    "OomcastAgentDown",
    "OomcastAgentNotSampling",  # no samples from an agent
    "OomcastAgentNotPublishing",
}


def test_rules_are_complete_and_each_says_what_to_check_first() -> None:
    rules = load_rules()
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names), "an alert name twice"
    assert set(names) >= REQUIRED_ALERTS, REQUIRED_ALERTS - set(names)
    for rule in rules:
        name = rule["alert"]
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, name
        assert DURATION.match(rule["for"]), f"{name}: for {rule['for']!r}"
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert set(notes) == {"summary", "description"}, name
        assert len(notes["summary"]) <= 100, f"{name}: summary too long for a page"
        assert "Check first" in notes["description"], f"{name}: no runbook line"


def test_every_rule_names_what_oomcast_exports(exported: Exported) -> None:
    found = {r["alert"]: problems(r["expr"], exported) for r in load_rules()}
    assert {name: p for name, p in found.items() if p} == {}


def test_the_jobs_the_rules_select_are_the_ones_the_scrape_configs_name() -> None:
    jobs = {m for r in load_rules() for m in re.findall(r'job="([^"]+)"', r["expr"])}
    assert jobs == {"oomcast-service", "oomcast-agent"}
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert {j["job_name"] for j in config["scrape_configs"]} == jobs
    assert config["rule_files"] == [RULES.name]
    # a PodMonitor's job is the value of its jobLabel on the pod: the pods' own labels
    pod_labels = {}
    for path in KUBE.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in ("Deployment", "DaemonSet"):
                pod_labels[doc["metadata"]["name"]] = doc["spec"]["template"]["metadata"]["labels"]
    monitors = list(yaml.safe_load_all(PODMONITORS.read_text()))
    assert len(monitors) == 2
    seen = set()
    for mon in monitors:
        assert mon["apiVersion"] == "monitoring.coreos.com/v1" and mon["kind"] == "PodMonitor"
        selected = [
            labels
            for labels in pod_labels.values()
            if mon["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(selected) == 1, f"{mon['metadata']['name']} selects {len(selected)} workloads"
        job = selected[0][mon["spec"]["jobLabel"]]
        seen.add(job)
        for endpoint in mon["spec"]["podMetricsEndpoints"]:
            targets = {r.get("targetLabel") for r in endpoint.get("relabelings", [])}
            # the agents' series are named by the pod's node; the service's per-domain
            # series carry their domain's own `node`, which a target label would rename
            assert ("node" in targets) == (job == "oomcast-agent"), (job, targets)
    assert seen == jobs
    for scrape in config["scrape_configs"]:
        targets = {r.get("target_label") for r in scrape.get("relabel_configs", [])}
        assert ("node" in targets) == (scrape["job_name"] == "oomcast-agent"), scrape["job_name"]
    assert "node" in target_labels()


def test_the_operator_resource_carries_the_same_rules_and_stays_out_of_the_kustomization() -> None:
    resource = yaml.safe_load(OPERATOR_RULE.read_text())
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["kind"] == "PrometheusRule"
    assert resource["metadata"]["namespace"] == "oomcast"
    assert resource["spec"] == yaml.safe_load(RULES.read_text())
    for kustomization in (
        KUBE / "kustomization.yaml",
        ROOT / "deploy/kubernetes-trial/kustomization.yaml",
    ):
        text = kustomization.read_text()
        assert "kubernetes-extras" not in text and "monitoring.coreos.com" not in text
    for path in KUBE.glob("*.yaml"):
        assert "monitoring.coreos.com" not in path.read_text(), path.name


# =============================================================================================
# promtool: the rules, every dashboard query, and the alerts' behaviour on synthetic series
# =============================================================================================
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian: apt-get install prometheus); the rules and "
    "queries are then checked by the static tests only",
)


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60, cwd=cwd
    )


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    done = promtool("check", "rules", RULES)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in done.stdout


@needs_promtool
def test_promtool_checks_the_example_configuration(tmp_path: Path) -> None:
    """Debian's Prometheus is built without Kubernetes discovery, so the copy checked here
    has static targets in its place; the relabelling and the rule file are checked as
    shipped."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs")
        job["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    done = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def grafana_to_promql(expr: str) -> str:
    """A dashboard query as Prometheus gets it, Grafana's variables substituted."""
    values = {**GRAFANA_VARS, "topn": "10"}
    return _VAR.sub(lambda m: values.get(m.group(1) or m.group(2), ".*"), expr)


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    queries = [expr for _, expr in dashboard_queries(load_dashboard())]
    rules = [
        {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(q)}
        for i, q in enumerate(queries)
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = promtool("check", "rules", path)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_would_refuse_a_broken_query(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    broken = {"record": "x:y", "expr": "sum(rate(a[5m]) by (b)"}
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [broken]}]}))
    assert promtool("check", "rules", path).returncode != 0


# The alerts on synthetic series, one minute apart: a healthy fleet (one replica s:8000, one
# agent a:9101 on node n1, 10 samples/s forecast within 10 ms), and for each alert the one
# change that should fire it, when it should go from quiet to firing.
SVC = 'job="oomcast-service", instance="s:8000"'
AGENT = 'job="oomcast-agent", instance="a:9101", node="n1"'
SVC_LABELS = {"job": "oomcast-service", "instance": "s:8000"}
AGENT_LABELS = {"job": "oomcast-agent", "instance": "a:9101", "node": "n1"}
HEALTHY = {
    f"up{{{SVC}}}": "1x40",
    f"up{{{AGENT}}}": "1x40",
    f"oomcast_redis_up{{{SVC}}}": "1x40",
    f"oomcast_partitions_owned{{{SVC}}}": "4x40",
    f"oomcast_samples_ingested_total{{{SVC}}}": "0+600x40",
    f"oomcast_agent_samples_total{{{AGENT}}}": "0+600x40",
    f"oomcast_agent_samples_sent_total{{{AGENT}}}": "0+600x40",
    f"oomcast_agent_samples_dropped_total{{{AGENT}}}": "0x40",
    f"oomcast_agent_nvml_gpus_lost_total{{{AGENT}}}": "0x40",
    f'oomcast_samples_rejected_total{{{SVC}, reason="schema"}}': "0x40",
    f'oomcast_deliveries_total{{{SVC}, target="webhook", result="delivered"}}': "0+1x40",
    f'oomcast_deliveries_total{{{SVC}, target="webhook", result="expired"}}': "0x40",
    f'oomcast_deliveries_owed{{{SVC}, target="webhook"}}': "0x40",
    f'oomcast_deliveries_failing{{{SVC}, target="webhook"}}': "0x40",
    f'oomcast_deliveries_overdue{{{SVC}, target="webhook"}}': "0x40",
    f'oomcast_deliveries_oldest_owed_seconds{{{SVC}, target="webhook"}}': "0x40",
} | {
    f'oomcast_forecast_latency_seconds_bucket{{{SVC}, le="{le}"}}': "0+600x40"
    for le in ("0.01", "1", "2.5", "5", "10", "+Inf")
}


def _latency(slowest_empty_le: str) -> dict[str, str]:
    """Every observation above the bucket ``slowest_empty_le`` and within the next one."""
    les = ("0.01", "1", "2.5", "5", "10", "+Inf")
    empty = les[: les.index(slowest_empty_le) + 1]
    return {f'oomcast_forecast_latency_seconds_bucket{{{SVC}, le="{le}"}}': "0x40" for le in empty}


@dataclass(frozen=True)
class Case:
    alert: str
    change: Mapping[str, str | None]  # series -> values, or None: the series is not there
    quiet: str  # eval time at which it has not fired yet
    fires: str  # eval time at which it fires
    labels: dict[str, str]


CASES = [
    Case("OomcastServiceDown", {f"up{{{SVC}}}": "1x5 0x35"}, "7m", "8m", SVC_LABELS),
    Case("OomcastServiceAbsent", {f"up{{{SVC}}}": None}, "9m", "10m", {"job": "oomcast-service"}),
    Case(
        "OomcastRedisUnreachable",
        {f"oomcast_redis_up{{{SVC}}}": "1x5 0x35"},
        "7m",
        "8m",
        SVC_LABELS,
    ),
    Case(
        "OomcastReplicaWithoutPartitions",
        {f"oomcast_partitions_owned{{{SVC}}}": "4x5 0x35"},
        "15m",
        "16m",
        SVC_LABELS,
    ),
    # forecasts stop at 5m; the 5m rate is 0 from 10m, and firing 5m later
    Case(
        "OomcastIngestStalled",
        {f"oomcast_samples_ingested_total{{{SVC}}}": "0+600x5 3000x35"},
        "14m",
        "15m",
        {},
    ),
    # half of what is sent is forecast, from the first rate (1m) on, firing 15m later
    Case(
        "OomcastIngestFallingBehind",
        {f"oomcast_samples_ingested_total{{{SVC}}}": "0+300x40"},
        "15m",
        "16m",
        {},
    ),
    Case("OomcastForecastLatencyHigh", _latency("1"), "10m", "11m", SVC_LABELS),
    Case("OomcastForecastLatencyCritical", _latency("5"), "5m", "6m", SVC_LABELS),
    Case(
        "OomcastDeadLettersRising",
        {f'oomcast_samples_rejected_total{{{SVC}, reason="schema"}}': "0x5 0+2x35"},
        "8m",
        "25m",
        {"reason": "schema"},
    ),
    Case(
        "OomcastDeliveriesFailing",
        {f'oomcast_deliveries_failing{{{SVC}, target="webhook"}}': "0x5 2x35"},
        "10m",
        "11m",
        {"target": "webhook"},
    ),
    Case(
        "OomcastDeliveryBacklogGrowing",
        {
            f'oomcast_deliveries_overdue{{{SVC}, target="webhook"}}': "0x5 1x35",
            f'oomcast_deliveries_owed{{{SVC}, target="webhook"}}': "0x5 1+1x35",
        },
        "15m",
        "16m",
        {"target": "webhook"},
    ),
    # 660 s old at 6m, 960 s (over 900) at 11m, firing 5m later
    Case(
        "OomcastDeliveriesStuck",
        {f'oomcast_deliveries_oldest_owed_seconds{{{SVC}, target="webhook"}}': "0x5 660+60x35"},
        "15m",
        "16m",
        {"target": "webhook"},
    ),
    Case(
        "OomcastDeliveriesGivenUp",
        {f'oomcast_deliveries_total{{{SVC}, target="webhook", result="expired"}}': "0x5 1x35"},
        "6m",
        "7m",
        {"target": "webhook", "result": "expired"},
    ),
    Case("OomcastAgentDown", {f"up{{{AGENT}}}": "1x5 0x35"}, "10m", "11m", AGENT_LABELS),
    Case("OomcastAgentsAbsent", {f"up{{{AGENT}}}": None}, "14m", "15m", {"job": "oomcast-agent"}),
    Case(
        "OomcastAgentNotSampling",
        {
            f"oomcast_agent_samples_total{{{AGENT}}}": "0+600x5 3000x35",
            f"oomcast_agent_samples_sent_total{{{AGENT}}}": "0+600x5 3000x35",
        },
        "19m",
        "20m",
        AGENT_LABELS,
    ),
    Case(
        "OomcastAgentNotPublishing",
        {f"oomcast_agent_samples_sent_total{{{AGENT}}}": "0+600x5 3000x35"},
        "14m",
        "15m",
        AGENT_LABELS,
    ),
    Case(
        "OomcastAgentDroppingSamples",
        {f"oomcast_agent_samples_dropped_total{{{AGENT}}}": "0x5 1+1x35"},
        "6m",
        "7m",
        AGENT_LABELS,
    ),
    Case(
        "OomcastGpuLost",
        {f"oomcast_agent_nvml_gpus_lost_total{{{AGENT}}}": "0x5 1x35"},
        "6m",
        "7m",
        AGENT_LABELS,
    ),
]


def test_every_alert_has_a_case_and_the_cases_use_exported_series(exported: Exported) -> None:
    rules = {r["alert"] for r in load_rules()}
    assert {c.alert for c in CASES} == rules
    for series in [*HEALTHY, *(s for c in CASES for s in c.change)]:
        assert problems(series, exported) == [], series


def alert_unit_tests(rules: list[dict[str, Any]]) -> dict[str, Any]:
    """promtool's test file: the healthy fleet stays quiet; each case fires its alert."""
    severity = {r["alert"]: r["labels"]["severity"] for r in rules}

    def series(values: Mapping[str, str | None]) -> list[dict[str, str]]:
        return [{"series": s, "values": v} for s, v in values.items() if v is not None]

    tests = [
        {
            "interval": "1m",
            "input_series": series(dict(HEALTHY)),
            "alert_rule_test": [
                {"eval_time": t, "alertname": name, "exp_alerts": []}
                for name in severity
                for t in ("5m", "20m", "39m")
            ],
        }
    ]
    for case in CASES:
        labels = {"severity": severity[case.alert], **case.labels}
        tests.append(
            {
                "interval": "1m",
                "input_series": series({**HEALTHY, **case.change}),
                "alert_rule_test": [
                    {"eval_time": case.quiet, "alertname": case.alert, "exp_alerts": []},
                    {
                        "eval_time": case.fires,
                        "alertname": case.alert,
                        "exp_alerts": [{"exp_labels": labels}],
                    },
                ],
            }
        )
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}


@pytest.mark.slow  # promtool evaluates 20 scenarios of 40 minutes each: 3-5 s here
@needs_promtool
def test_promtool_alerts_fire_when_they_should(tmp_path: Path) -> None:
    """promtool compares annotations too; the copy it tests has none (their templates are
    checked by `promtool check rules` above), so each case states labels and timing only."""
    groups = yaml.safe_load(RULES.read_text())
    for group in groups["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    tests = alert_unit_tests(load_rules())
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests))
    done = promtool("test", "rules", "tests.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # and a case set one minute early is a failure: the timing is really checked
    early = copy.deepcopy(tests)
    early["tests"][1]["alert_rule_test"][1]["eval_time"] = CASES[0].quiet
    (tmp_path / "early.yaml").write_text(yaml.safe_dump(early))
    assert promtool("test", "rules", "early.yaml", cwd=tmp_path).returncode != 0


def test_no_series_of_the_service_carries_a_label_its_scrape_sets() -> None:
    # Prometheus renames a series' own label that a scrape also sets (job -> exported_job):
    # a per-domain series with `job` would lose its training job to the scrape's
    service_targets = {"job", "instance"} | OPERATOR_TARGET_LABELS
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for scrape in config["scrape_configs"]:
        if scrape["job_name"] == "oomcast-service":
            service_targets |= {
                r["target_label"] for r in scrape["relabel_configs"] if "target_label" in r
            }
    exported = service_exports()
    clashes = {
        (name, label)
        for name, labels in exported.items()
        for label in (labels or frozenset()) & service_targets
    }
    assert not clashes, clashes
    assert exported["oomcast_domain_oom_risk"] == {"node", "device", "kind", "job_name", "horizon"}
