"""Contract tests: schemathesis generates requests from the app's own OpenAPI document and
runs every check it has against the live app (lifespan, ingest loop and real Redis under a
private key prefix), with the token configured."""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from pydantic import SecretStr
from schemathesis.python import asgi as st_asgi
from support import T0, wait_until

from oomcast.model.schema import SANITY_FACTOR
from oomcast.service.main import create_app
from oomcast.service.settings import Settings

TOKEN = "contract-token"
PREFIX = f"oomcast-test-{uuid.uuid4().hex[:10]}"
REDIS_URL = os.environ.get("OOMCAST_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
# Built at import, cheaply (create_app starts nothing); the fixture below starts and stops
# its lifespan.
APP = create_app(
    Settings(
        redis_url=REDIS_URL,
        key_prefix=PREFIX,
        partitions=2,
        consumer_name="contract-test",
        forecaster="predict_linear_w60s_h60s_gate0.80_full",
        api_token=SecretStr(TOKEN),
        # The clock-skew bound on /v1/samples depends on when the test runs, which no
        # schema can say (the document's own example is from 2025); test_input_bounds.py
        # tests it.
        max_ts_skew_s=0,
    )
)
CONFIG = schemathesis.Config.from_dict(
    {
        # Through the document's own security scheme, so schemathesis also sends requests
        # without it (and expects the 401s).
        "auth": {"openapi": {"HTTPBearer": {"bearer": TOKEN}}},
        # The API ignores query parameters it does not know, as OpenAPI lets it.
        "generation": {"allow-extra-parameters": False},
    }
)
schema = schemathesis.openapi.from_dict(APP.openapi(), config=CONFIG)
schema.app = APP


SAMPLE_BODIES = {"/v1/samples", "/v1/predict"}
BYTE_FIELDS = ("used_bytes", "allocated_bytes", "reserved_bytes", "peak_bytes")


def keep_cross_field_rules(body: dict[str, Any], *, one_domain: bool) -> None:
    """Make a schema-valid body also keep the rules JSON Schema cannot state (each said in
    the document's words): byte counts at most SANITY_FACTOR x total_bytes, increasing ts
    within a domain, and one domain per /v1/predict. Nothing else is touched."""
    items = body.get("samples")
    if not isinstance(items, list) or not items:
        return
    shaped = {"total_bytes": int | float, "ts": int | float, "node": str, "device": str}
    if not all(
        isinstance(s, dict) and all(isinstance(s.get(k), t) for k, t in shaped.items())
        for s in items
    ):
        return  # not a body the schema calls valid: leave it as generated
    for s in items:
        bound = int(SANITY_FACTOR * s["total_bytes"])
        for key in BYTE_FIELDS:
            if isinstance(s.get(key), int | float) and s[key] > bound:
                s[key] = bound
        for proc in s.get("processes") or []:  # each process's used_bytes has the same bound
            used = proc.get("used_bytes") if isinstance(proc, dict) else None
            if isinstance(used, int | float) and used > bound:
                proc["used_bytes"] = bound
        if one_domain:
            s["node"], s["device"] = items[0]["node"], items[0]["device"]
    by_domain: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in items:
        by_domain.setdefault((s["node"], s["device"]), []).append(s)
    for group in by_domain.values():
        if any(b["ts"] <= a["ts"] for a, b in itertools.pairwise(group)):
            for k, s in enumerate(group):
                s["ts"] = T0 + k


@schema.hook
def map_case(context: schemathesis.HookContext, case: Any) -> Any:
    positive = case.meta is not None and case.meta.generation.mode.is_positive
    if positive and case.operation.path in SAMPLE_BODIES and isinstance(case.body, dict):
        keep_cross_field_rules(case.body, one_domain=case.operation.path == "/v1/predict")
    return case


@pytest.fixture(scope="module", autouse=True)
def private_keys(redis_url: str) -> Iterator[None]:
    """Removes what the app wrote under its private key prefix once the module is done."""
    yield
    st_asgi.shutdown_lifespans()  # the ingest loop stops, Redis is closed
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{PREFIX}:*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(autouse=True)
def live_app() -> None:
    """Starts the app's lifespan in schemathesis's event loop (the one its requests use) and
    waits until it is ready: a /readyz 503 while ingest starts up would be a true answer
    that the "no server errors" check still counts. Per test, because schemathesis's pytest
    plugin ends every ASGI lifespan when a test ends, and the next request starts a new one
    whose ingest is not ready yet."""
    with st_asgi.get_client(cast(Any, APP)) as http:
        assert wait_until(lambda: http.get("/readyz").status_code == 200), "app never ready"


@pytest.mark.slow  # about 20 s for all operations on two cores
@schema.parametrize()
# Bounded: 25 generated requests per operation and mode, besides the coverage phase's
# boundary cases; no per-example deadline (the first request starts the lifespan).
@hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_keeps_its_contract(case: Any) -> None:
    """Every check schemathesis has (status codes, content types, response and header
    schemas, positive data accepted, negative data rejected, auth enforced) holds."""
    case.call_and_validate()
