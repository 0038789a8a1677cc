"""The web dashboard (service/static, served by routes/dashboard.py) in a real headless
Chromium, through Playwright, against a real `oomcast serve` on the real Redis.

Samples reach the service the way the node agent sends them: entries on the node's sample
stream (``encode_samples``). One server runs the shipped model with an API token; on it a
healthy domain sits at 40% while others leak straight to the limit within a minute, which
the model alerts on ~6 s before the end (the same leak, stepped offline, alerts at sample
54 of 60). A second server, on a baseline forecaster, holds 5,000 domains for the
virtualised table. Browser console errors and uncaught page errors fail every test.

Chromium comes from Debian's ``chromium`` package (``OOMCAST_CHROMIUM`` names another
binary); Playwright's own browser downloads are not used. Screenshots go to
``OOMCAST_TEST_ARTIFACTS`` (a temporary folder unless set).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
from support import GIB, free_port, sample, start_serve, wait_until

from oomcast.model.processes import ProcessUse
from oomcast.model.runtime import DEFAULT_MODEL
from oomcast.model.wire import Keys, encode_samples, sample_payload
from oomcast.service.pipeline.outcomes import CHAMPION, SHADOW, Outcome
from oomcast.service.scorecard import OutcomeStore

pytest.importorskip(
    "playwright", reason="playwright is not installed (pip install playwright pytest-playwright)"
)
from playwright.sync_api import Browser, Page, expect, sync_playwright

CHROMIUM = (
    os.environ.get("OOMCAST_CHROMIUM")
    or shutil.which("chromium")
    or shutil.which("chromium-browser")
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="no Chromium to drive: install Debian's `chromium` package (apt-get install"
        " chromium) or set OOMCAST_CHROMIUM to a Chromium binary",
    ),
]

TOKEN = "dashboard-test-token"
TOKEN_KEY = "oomcast.api_token"  # what app.js keeps in sessionStorage
FIRING = re.compile(r"\bfiring\b")
POOL = 12  # quiet domains besides the three the tests watch
SEEN_S = 15  # how long the page may take to show what the service knows (polls ~1.5 s)


# Playwright's own fixtures (pytest-playwright) keep one Playwright for the whole session,
# and its sync API leaves an event loop running in the main thread: every later test that
# calls asyncio.run() then fails. So this module starts and stops its own.


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    """Debian's Chromium, headless, without the sandbox (CI runs as root), for this module."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(chromium: Browser) -> Iterator[Page]:
    """A fresh tab in a fresh context (its own sessionStorage) for each test."""
    context = chromium.new_context()
    tab = context.new_page()
    yield tab
    context.close()


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("OOMCAST_TEST_ARTIFACTS")
    path = Path(where) if where else tmp_path_factory.mktemp("dashboard")
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Server:
    base: str
    keys: Keys
    client: redis.Redis
    token: str | None
    last_ts: dict[tuple[str, str], float] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def get(self, path: str) -> Any:
        r = httpx.get(f"{self.base}{path}", headers=self.headers(), timeout=10)
        r.raise_for_status()
        return r.json()

    def feed(
        self,
        node: str,
        device: str,
        fracs: list[float],
        job: str,
        hook: bool = False,
        processes: tuple[ProcessUse, ...] | None = None,
    ) -> None:
        """One stream entry with a sample per value, a second apart, after the domain's last."""
        start = max(self.last_ts.get((node, device), 0.0) + 1, time.time() - len(fracs))
        payloads = []
        for i, frac in enumerate(fracs):
            extra: dict[str, Any] = {}
            if hook:  # the in-job hook's allocator figures
                used = int(frac * 80 * GIB)
                extra = {"allocated_bytes": int(used * 0.8), "reserved_bytes": int(used * 0.9)}
            if processes is not None:
                extra["processes"] = processes
            s = sample(start + i, frac, node=node, device=device, job=job, **extra)
            payloads.append(sample_payload(s, None, None))
        self.last_ts[(node, device)] = start + len(fracs) - 1
        self.client.xadd(self.keys.samples_for(node), encode_samples(node, payloads))  # type: ignore[arg-type]

    def seen(self, node: str, device: str) -> dict[str, Any] | None:
        r = httpx.get(f"{self.base}/v1/devices/{node}/{device}", headers=self.headers())
        return r.json() if r.status_code == 200 else None

    def leak(self, node: str, device: str, job: str) -> None:
        """A straight leak from half to 97% of the GPU in a minute; waits for the alert."""
        self.feed(node, device, [0.5 + 0.47 * i / 59 for i in range(60)], job, hook=True)

        def firing() -> bool:
            got = self.seen(node, device)
            return got is not None and bool(got["alert"]["firing"])

        assert wait_until(firing, 30), f"the model did not alert on the leak of {node}/{device}"


@contextlib.contextmanager
def serving(env_extra: dict[str, str], redis_url: str) -> Iterator[Server]:
    """`oomcast serve` on a key prefix of its own, removed afterwards."""
    prefix = f"oomcast-test-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "OOMCAST_REDIS_URL": redis_url, "OOMCAST_KEY_PREFIX": prefix}
    for key in [k for k in env if k.startswith(("OOMCAST_ALERT_", "OOMCAST_FORECASTER"))]:
        env.pop(key)
    env.pop("OOMCAST_MODEL_PATH", None)
    env.pop("OOMCAST_API_TOKEN", None)
    env.update({"OOMCAST_CONSUMER_NAME": "dashboard", **env_extra})
    port = free_port()
    proc: subprocess.Popen[bytes] = start_serve(env, port)
    client = redis.Redis.from_url(redis_url)
    try:
        yield Server(f"http://127.0.0.1:{port}", Keys(prefix), client, env.get("OOMCAST_API_TOKEN"))
    finally:
        proc.terminate()
        proc.wait(15)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture(scope="module")
def server(redis_url: str) -> Iterator[Server]:
    """The shipped model, a token, a healthy domain and two still quiet ones."""
    if not DEFAULT_MODEL.is_file():
        pytest.skip("no shipped model (model/*.onnx)")
    with serving({"OOMCAST_API_TOKEN": TOKEN}, redis_url) as srv:
        srv.feed("dash-a", "gpu0", [0.4] * 30, "train-a")
        srv.feed("dash-b", "gpu1", [0.5] * 30, "train-b", hook=True)
        srv.feed("dash-c", "gpu0", [0.5] * 30, "train-c")
        for i in range(POOL):  # a steady training job's sawtooth, at several levels
            level = 0.45 + 0.4 * i / POOL
            fracs = [level + 0.04 * (t % 10) / 10 for t in range(30)]
            srv.feed(f"pool-{i // 2}", f"gpu{i % 2}", fracs, "pretrain-7b")
        assert wait_until(lambda: all(srv.seen(n, d) for n, d in srv.last_ts), 20)
        yield srv


@pytest.fixture(scope="module")
def fired(server: Server) -> Server:
    """dash-b/gpu1 leaked and alerting."""
    server.leak("dash-b", "gpu1", "train-b")
    return server


@pytest.fixture
def errors(page: Page) -> Iterator[list[str]]:
    """Console errors and uncaught exceptions of the page; the test fails on any."""
    got: list[str] = []
    page.on("console", lambda m: got.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: got.append(f"pageerror: {e}"))
    yield got
    assert got == [], got


@pytest.fixture
def authed(page: Page, errors: list[str]) -> Page:
    """A page whose tab already holds the token (as after entering it once)."""
    page.add_init_script(f"sessionStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(TOKEN)})")
    return page


def row(page: Page, node: str, device: str) -> Any:
    return page.locator(f'.rows .row[data-key="{node}/{device}"]')


def test_the_page_needs_no_token_but_asks_for_it_once_on_a_401(server: Server, page: Page) -> None:
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on(
        "console",
        lambda m: (
            problems.append(m.text)
            if m.type == "error" and "status of 401" not in m.text  # the refused requests
            else None
        ),
    )
    assert httpx.get(f"{server.base}/").status_code == 200  # the page itself: no token
    assert httpx.get(f"{server.base}/v1/devices").status_code == 401
    page.goto(f"{server.base}/")
    panel = page.locator("#token-panel")
    expect(panel).to_be_visible(timeout=SEEN_S * 1000)
    expect(panel).to_contain_text("401 Unauthorized")
    expect(panel).to_contain_text("sessionStorage")
    page.fill("#token-input", "wrong")
    page.click("#token-form button")
    expect(panel).to_contain_text("refused", timeout=SEEN_S * 1000)
    page.fill("#token-input", TOKEN)
    page.click("#token-form button")
    expect(panel).to_be_hidden()
    expect(row(page, "dash-a", "gpu0")).to_be_visible(timeout=SEEN_S * 1000)
    assert page.evaluate(f"sessionStorage.getItem({json.dumps(TOKEN_KEY)})") == TOKEN
    page.reload()  # kept for the tab: not asked again
    expect(row(page, "dash-a", "gpu0")).to_be_visible(timeout=SEEN_S * 1000)
    expect(panel).to_be_hidden()
    assert problems == [], problems


def test_a_domain_heading_for_oom_turns_red_with_its_alert_within_seconds(
    server: Server, authed: Page, artifacts: Path
) -> None:
    page = authed
    page.goto(f"{server.base}/")
    doomed = row(page, "dash-c", "gpu0")
    healthy = row(page, "dash-a", "gpu0")
    expect(healthy).to_be_visible(timeout=SEEN_S * 1000)
    expect(doomed).to_be_visible()
    expect(doomed).not_to_have_class(FIRING)
    expect(healthy.locator(".mem small")).to_contain_text("32.0 / 80.0 GiB · 40%")
    server.leak("dash-c", "gpu0", "train-c")  # returns once the API says it fires
    expect(doomed).to_have_class(FIRING, timeout=SEEN_S * 1000)
    # a leak this fast fires the shed rule too (risk within 30 s >= 0.9): both are listed
    expect(doomed.locator(".alert")).to_contain_text(re.compile(r"FIRING .*oom-forecast"))
    expect(doomed.locator(".tto")).not_to_have_text("—")
    # riskiest first: a firing domain heads the table, the healthy one stays quiet
    expect(page.locator(".rows .row").first).to_have_class(FIRING)
    expect(healthy).not_to_have_class(FIRING)
    expect(healthy.locator(".alert")).to_have_text("ok")
    # the risk sparkline climbed: its line has one point per forecast the page has seen
    assert doomed.locator("svg.spark path.line").count() == 1
    page.screenshot(path=str(artifacts / "dashboard-fleet.png"))


def test_filtering_by_node_and_job_asks_the_server(fired: Server, authed: Page) -> None:
    page = authed
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url) if "/v1/devices?" in r.url else None)
    page.goto(f"{fired.base}/")
    expect(row(page, "dash-b", "gpu1")).to_be_visible(timeout=SEEN_S * 1000)
    page.fill("input[name=node]", "dash-a")
    expect(page.locator(".rows .row")).to_have_count(1, timeout=SEEN_S * 1000)
    expect(row(page, "dash-a", "gpu0")).to_be_visible()
    expect(page.locator("#fleet-summary")).to_contain_text(
        f"1 of {POOL + 3} live domains match node dash-a"
    )
    assert any("node=dash-a" in url for url in asked), asked
    assert "node=dash-a" in page.url  # the filtered view has its own address
    page.fill("input[name=node]", "dash-*")
    page.fill("input[name=job]", "train-b")
    expect(page.locator(".rows .row")).to_have_count(1, timeout=SEEN_S * 1000)
    expect(row(page, "dash-b", "gpu1")).to_have_class(FIRING)
    page.fill("input[name=job]", "no-such-job")
    expect(page.locator(".rows .empty")).to_contain_text("No live domain matches")


def test_the_domain_page_draws_memory_forecast_alerts_and_cause(
    fired: Server, authed: Page, artifacts: Path
) -> None:
    page = authed
    summary = fired.get("/v1/devices/dash-b/gpu1")
    page.goto(f"{fired.base}/")
    row(page, "dash-b", "gpu1").locator("a").click()
    expect(page).to_have_url(re.compile(r"#/domain/dash-b/gpu1$"))
    chart = page.locator("#memory-chart")
    used = chart.locator("path.line.used")
    expect(used).to_have_attribute(
        "d", re.compile(r"^M[\d.,]+(L[\d.,]+){80,}$"), timeout=SEEN_S * 1000
    )
    expect(chart.locator("path.line.capacity")).to_have_count(1)
    # the hook's allocator figures, read back from the node's stream
    expect(chart.locator("path.line.allocated")).to_have_attribute(
        "d", re.compile(r"(L[\d.,]+){50,}")
    )
    expect(chart.locator("path.line.reserved")).to_have_count(1)
    firing = [
        a
        for a in fired.get("/v1/alerts")["alerts"]
        if (a["node"], a["device"], a["status"]) == ("dash-b", "gpu1", "firing")
    ]
    assert firing, "the fixture's leak fired no alert"
    # each alert, on the timeline
    expect(chart.locator(".marker.firing")).to_have_count(len(firing))
    expect(chart.locator(".segment.projection")).to_have_count(1)  # where use meets the limit
    expect(chart.locator("text.label.projection")).to_contain_text("OOM in")
    risk = page.locator("#risk-chart")
    expect(risk.locator("path.line.risk")).to_have_attribute("d", re.compile(r"(L[\d.,]+){80,}"))
    expect(risk.locator("path.band.forecast")).to_have_count(1)
    expect(page.locator("#domain-title")).to_have_class("firing")
    rows = page.locator("#domain-alerts .alert-row.firing")
    expect(rows).to_have_count(len(firing))
    expect(rows.filter(has_text="oom-forecast")).to_have_count(1)
    cause = page.locator("#domain-cause")
    if summary.get("cause"):
        expect(cause.locator(".cause-kind")).to_have_text(str(summary["cause"]))
    else:
        expect(cause).to_contain_text("no cause computed")
    page.screenshot(path=str(artifacts / "dashboard-domain.png"), full_page=True)


def test_a_shared_gpu_lists_its_processes_largest_first(
    server: Server, authed: Page, artifacts: Path
) -> None:
    procs = (
        ProcessUse(311, 6 * GIB, "eval-sidecar"),
        ProcessUse(4242, 40 * GIB, "train-shared"),
        ProcessUse(977, None),  # NVML gave no figure for this one
    )
    server.feed("dash-shared", "gpu3", [0.6] * 20, "train-shared", processes=procs)
    assert wait_until(lambda: server.seen("dash-shared", "gpu3") is not None, 20)
    page = authed
    page.goto(f"{server.base}/#/domain/dash-shared/gpu3")
    box = page.locator("#domain-procs")
    expect(box.locator("h2")).to_have_text("Processes on this GPU (3)", timeout=SEEN_S * 1000)
    cells = box.locator("tbody tr").evaluate_all(
        "rows => rows.map(r => [...r.cells].slice(0, 4).map(c => c.textContent))"
    )
    assert cells == [
        ["4242", "train-shared", "40.0 GiB", "50%"],  # the domain's own job, first
        ["311", "eval-sidecar", "6.0 GiB", "8%"],
        ["977", "—", "not reported", "—"],
        ["—", "not in any process (driver context, others)", "2.0 GiB", "3%"],
    ]
    expect(box.locator("tbody tr.own")).to_have_count(1)
    page.screenshot(path=str(artifacts / "dashboard-processes.png"), full_page=True)


def test_a_domain_without_processes_shows_no_process_table(server: Server, authed: Page) -> None:
    authed.goto(f"{server.base}/#/domain/dash-a/gpu0")
    expect(authed.locator("#domain-facts .fact").first).to_be_visible(timeout=SEEN_S * 1000)
    expect(authed.locator("#domain-procs *")).to_have_count(0)


def test_a_domain_that_is_not_live_says_so(server: Server, page: Page) -> None:
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on(
        "console",
        lambda m: (
            problems.append(m.text)
            if m.type == "error" and "status of 404" not in m.text  # the domain's lookup
            else None
        ),
    )
    page.add_init_script(f"sessionStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(TOKEN)})")
    page.goto(f"{server.base}/#/domain/dash-z/gpu9")
    expect(page.locator("#domain-facts")).to_contain_text(
        "dash-z/gpu9 is not a live domain", timeout=SEEN_S * 1000
    )
    assert problems == [], problems


def test_the_alert_log_lists_the_alert(fired: Server, authed: Page, artifacts: Path) -> None:
    page = authed
    (alert,) = [
        a
        for a in fired.get("/v1/alerts")["alerts"]
        if (a["node"], a["status"], a["rule_name"]) == ("dash-b", "firing", "oom-forecast")
    ]
    page.goto(f"{fired.base}/#/alerts")
    line = page.locator(".alert-row.firing", has_text="dash-b/gpu1").filter(has_text="oom-forecast")
    expect(line).to_have_count(1, timeout=SEEN_S * 1000)
    expect(line).to_contain_text(alert["rule_name"])
    expect(line).to_contain_text("train-b")
    # the time in an order no locale reads two ways (it was 12/4/2026 in en-US)
    sent = time.localtime(alert.get("sent_at") or alert["observed_at"])
    expect(line).to_contain_text(time.strftime("%Y-%m-%d %H:%M:", sent))
    expect(line.locator(".cause")).to_contain_text(
        str(alert["cause"]) if alert.get("cause") else "no cause computed"
    )
    page.screenshot(path=str(artifacts / "dashboard-alerts.png"))
    page.fill("input[name=q]", "dash-a")
    expect(line).to_have_count(0)
    expect(page.locator("#alerts-summary")).to_contain_text("0 of the newest")


def test_the_alert_log_shows_a_cause_its_evidence_and_remedies(
    server: Server, authed: Page
) -> None:
    """An alert record that carries a diagnosis (model/causes.py's fields), written to the
    audit stream that /v1/alerts reads, as the service writes its own."""
    record = {
        "status": "firing",
        "node": "dash-f",
        "device": "gpu2",
        "job": "frag-job",
        "risk": {"120": 0.91},
        "horizon_s": 120,
        "time_to_oom_s": 40.0,
        "observed_at": time.time(),
        "sent_at": time.time(),
        "rule_name": "oom-forecast",
        "episode": "ep-frag",
        "cause": "fragmentation",
        "evidence": "reserved 76.0 GiB, allocated 58.0 GiB: 24% of the cache is unusable",
        "thin": ["no allocation sites from the hook"],
        "remedies": ["set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"],
        "dispatched": {"webhook": "owed"},
    }
    server.client.xadd(server.keys.alerts, {"alert": json.dumps(record)})
    page = authed
    page.goto(f"{server.base}/#/alerts")
    line = page.locator(".alert-row.firing", has_text="dash-f/gpu2")
    expect(line).to_have_count(1, timeout=SEEN_S * 1000)
    cause = line.locator(".cause")
    expect(cause.locator(".cause-kind")).to_have_text("fragmentation")
    expect(cause.locator(".evidence")).to_contain_text("24% of the cache is unusable")
    expect(cause.locator(".thin")).to_contain_text("no allocation sites from the hook")
    expect(cause.locator(".remedies li")).to_have_text(
        ["set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    )
    expect(line).to_contain_text("webhook owed")


# --- the scorecard --------------------------------------------------------------------


def scored(role: str, version: str, i: int, kind: str, **kw: Any) -> Outcome:
    fields: dict[str, Any] = dict(
        id=f"{role}-{i}", outcome=kind, ts=time.time() - 3600 + i, node="dash-s",
        device=f"gpu{i}", kind="gpu", job=f"job-{i % 2}", role=role, model_version=version,
    )  # fmt: skip
    return Outcome(**(fields | kw))


def test_the_scorecard_page_plots_each_scored_model(
    server: Server, authed: Page, artifacts: Path
) -> None:
    """A week by hand, for the champion and a shadow: the page shows each model's figures,
    its OOMs by class and how early they were warned, and what its alerts came to."""
    leak: dict[str, Any] = {"warned": "30s", "oom_class": "long", "cause": "leak"}
    champion = [
        scored(CHAMPION, "lstm-a", 1, "oom", lead_s=45.0, **leak),
        scored(CHAMPION, "lstm-a", 2, "oom", lead_s=90.0, **leak),
        scored(CHAMPION, "lstm-a", 3, "oom", warned="10s", oom_class="long", lead_s=12.0),
        scored(CHAMPION, "lstm-a", 4, "oom", warned="no", oom_class="sudden"),
        scored(CHAMPION, "lstm-a", 5, "false_alarm", cause="leak"),
        scored(CHAMPION, "lstm-a", 6, "near_miss", max_level=0.95),
        scored(CHAMPION, "lstm-a", 7, "censored"),
        scored(CHAMPION, "lstm-a", 8, "exposure", seconds=7200.0),
    ]  # fmt: skip
    shadow = [
        scored(SHADOW, "lstm-b", i, "oom", warned="30s", oom_class="long", lead_s=60.0)
        for i in range(1, 5)
    ] + [scored(SHADOW, "lstm-b", 8, "exposure", seconds=7200.0)]
    store = OutcomeStore(cast(Any, None), server.keys.prefix)  # stage only: no client needed
    pipe = server.client.pipeline(transaction=False)
    store.stage(pipe, champion + shadow)
    pipe.execute()
    page = authed
    page.goto(f"{server.base}/#/scorecard")
    cards = page.locator(".model-card")
    expect(cards).to_have_count(2, timeout=SEEN_S * 1000)
    first = page.locator('.model-card[data-role="champion"]')
    expect(first.locator("h2")).to_contain_text("lstm-a")
    expect(first.locator(".fact", has_text="recall at 30 s")).to_contain_text("50%")
    expect(first.locator(".fact", has_text="precision")).to_contain_text("75%")
    expect(first.locator(".fact", has_text="false alarms per 1,000 job-hours")).to_contain_text(
        "500"
    )
    # long: 2 warned >= 30 s, 1 at 10-30 s; sudden: 1 missed; alerts: 3 hits, 1 false alarm,
    # 1 near miss, 1 censored
    bars = first.locator("svg.bars")
    expect(bars.nth(0).locator(".part")).to_have_count(3)
    expect(bars.nth(0).locator(".part.missed title")).to_have_text(
        ["warned under 10 s ahead, or not at all: 1"]
    )
    expect(bars.nth(1).locator(".part")).to_have_count(4)
    expect(bars.nth(1).locator(".part.hit title")).to_have_text(["an OOM followed: 3"])
    other = page.locator('.model-card[data-role="shadow"]')
    expect(other.locator(".fact", has_text="recall at 30 s")).to_contain_text("100%")
    # unsealed (this service has no secret): the page says so
    expect(page.locator("#score-notes")).to_contain_text("not sealed")
    page.select_option("select[name=by]", "cause")
    expect(first.locator(".by-row")).to_have_count(2)  # leak, and "-" for no cause
    page.screenshot(path=str(artifacts / "dashboard-scorecard.png"), full_page=True)


# --- 5,000 domains --------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(redis_url: str) -> Iterator[Server]:
    """5,000 domains (625 nodes of 8 GPUs), no token, on a baseline forecaster (the table is
    what is tested here, not the model)."""
    env = {"OOMCAST_FORECASTER": "predict_linear_w60s_h60s_gate0.80_full"}
    with serving(env, redis_url) as srv:
        now = time.time()
        pipe = srv.client.pipeline(transaction=False)
        for n in range(625):
            node = f"big-{n:03d}"
            payloads = [
                sample_payload(
                    sample(
                        now - 2 + t,
                        0.3 + 0.6 * ((n * 8 + g) % 97) / 97,
                        node=node,
                        device=f"gpu{g}",
                        job=f"job-{n % 7}",
                    ),
                    None,
                    None,
                )
                for g in range(8)
                for t in range(3)
            ]
            pipe.xadd(srv.keys.samples_for(node), encode_samples(node, payloads))  # type: ignore[arg-type]
        pipe.execute()
        assert wait_until(lambda: srv.get("/v1/devices?limit=1")["total"] == 5000, 60)
        yield srv


def test_five_thousand_domains_page_from_the_server_and_draw_only_visible_rows(
    fleet: Server, page: Page, errors: list[str]
) -> None:
    sizes: list[int] = []
    page.on(
        "response",
        lambda r: sizes.append(len(r.json()["devices"])) if "/v1/devices?" in r.url else None,
    )
    page.goto(f"{fleet.base}/")
    expect(page.locator("#fleet-summary")).to_contain_text("5000 of 5000 live domains")
    drawn = page.locator(".rows .row").count()
    assert 10 <= drawn <= 80, drawn  # the visible rows and a few more, not 5,000
    assert max(sizes) <= 200  # a page at a time
    # the bottom of the table: reached by following the cursors, and drawn on its own
    page.locator("#fleet-scroll").evaluate("el => { el.scrollTop = el.scrollHeight; }")
    expect(page.locator('.rows .row[data-index="4999"]')).to_be_visible(timeout=SEEN_S * 1000)
    assert page.locator(".rows .row").count() <= 80
    keys = page.locator(".rows .row").evaluate_all("rows => rows.map(r => r.dataset.key)")
    assert len(set(keys)) == len(keys)
    # the last row is the least risky domain: the same as the API's own last page says
    risks = page.locator(".rows .row .risk").all_inner_texts()
    assert risks[-1] == "0%"
