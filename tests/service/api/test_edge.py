"""service/api/edge.py and the HTTP side of back-pressure: the token is checked and the body
limit enforced before a byte of the body is read; Redis refusing writes means 503 (with
Retry-After) for POST /v1/samples and for /readyz, and nothing of the request is kept."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema_rs
import pytest
import redis
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from support import GIB, T0, PrivateRedis, free_port, wait_until

from oomcast.model.wire import Keys
from oomcast.service.api.edge import DEFAULT_MAX_BODY_BYTES, EdgeMiddleware
from oomcast.service.main import create_app
from oomcast.service.settings import Settings

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HUGE = 116 * 1024 * 1024  # the size of the bodies that took the service to 3.2 GB


def settings(redis_url: str, key_prefix: str, **kw: Any) -> Settings:
    kw.setdefault("forecaster", "predict_linear_w60s_h60s_gate0.80_full")
    kw.setdefault("api_token", TOKEN)
    kw.setdefault("max_ts_skew_s", 0)  # samples stamped around T0 (2025)
    return Settings(
        redis_url=redis_url, key_prefix=key_prefix, partitions=2, consumer_name="edge-test", **kw
    )


def samples(n: int = 3, node: str = "n1") -> dict[str, Any]:
    return {
        "samples": [
            {
                "ts": T0 + i,
                "node": node,
                "device": "gpu0",
                "kind": "gpu",
                "total_bytes": 80 * GIB,
                "used_bytes": (40 + i) * GIB,
            }
            for i in range(n)
        ]
    }


# --- the app's ASGI callable, driven directly, so every byte it pulls is counted ----------


class Upload:
    """An ASGI ``receive`` that hands out ``total`` bytes in chunks and counts what was taken."""

    def __init__(self, total: int, chunk: int = 64 * 1024) -> None:
        self.left = total
        self.chunk = chunk
        self.pulled = 0
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.left <= 0:
            await asyncio.sleep(3600)  # the client went quiet: a server would wait
        part = min(self.chunk, self.left)
        self.left -= part
        self.pulled += part
        return {"type": "http.request", "body": b"[" * part, "more_body": self.left > 0}


def call(
    app: Any, path: str, headers: list[tuple[bytes, bytes]], upload: Upload, method: str = "POST"
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request through ``app``'s ASGI interface; (status, headers, body)."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }
    asyncio.run(asyncio.wait_for(app(scope, upload, send), timeout=30))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


BAD_CREDENTIALS: list[list[tuple[bytes, bytes]]] = [
    [],
    [(b"authorization", b"")],
    [(b"authorization", b"Bearer")],
    [(b"authorization", b"Bearer ")],
    [(b"authorization", b"Bearer wrong")],
    [(b"authorization", TOKEN.encode())],  # no scheme
    [(b"authorization", f"Basic {TOKEN}".encode())],  # another scheme
    [(b"authorization", f"Bearer {TOKEN}x".encode())],
    [(b"authorization", f"Bearer {TOKEN[:-1]}".encode())],
    [(b"authorization", "Bearer tökén".encode())],  # non-ASCII (UTF-8)
    [(b"authorization", b"Bearer t\xf6k\xe9n")],  # latin-1 bytes, not UTF-8
    [(b"authorization", b"\xff\xfe\x00")],
    [(b"authorization", b"Bearer wrong"), (b"authorization", f"Bearer {TOKEN}".encode())],
]


@pytest.mark.parametrize("credentials", BAD_CREDENTIALS, ids=repr)
def test_bad_credentials_get_401_before_the_body_is_read(
    redis_url: str, key_prefix: str, credentials: list[tuple[bytes, bytes]]
) -> None:
    app = create_app(settings(redis_url, key_prefix))
    upload = Upload(HUGE)
    headers = [(b"content-length", str(HUGE).encode()), *credentials]
    status, out_headers, body = call(app, "/v1/samples", headers, upload)
    assert status == 401, body
    assert upload.pulled == 0, f"read {upload.pulled} bytes of an unauthenticated body"
    assert out_headers[b"www-authenticate"] == b"Bearer"
    assert "bearer token" in json.loads(body)["detail"]


def test_chunked_unauthenticated_body_is_not_read_either(redis_url: str, key_prefix: str) -> None:
    app = create_app(settings(redis_url, key_prefix))
    upload = Upload(HUGE)
    status, _, _ = call(app, "/v1/predict", [(b"transfer-encoding", b"chunked")], upload)
    assert (status, upload.pulled) == (401, 0)


def test_declared_length_over_the_limit_gets_413_unread(redis_url: str, key_prefix: str) -> None:
    app = create_app(settings(redis_url, key_prefix))
    upload = Upload(HUGE)
    headers = [(b"content-length", str(DEFAULT_MAX_BODY_BYTES + 1).encode()), *auth_raw()]
    status, _, body = call(app, "/v1/samples", headers, upload)
    assert status == 413, body
    assert upload.pulled == 0
    assert str(DEFAULT_MAX_BODY_BYTES) in json.loads(body)["detail"]


def auth_raw() -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {TOKEN}".encode())]


@pytest.mark.parametrize("path", ["/v1/samples", "/v1/predict"])
def test_streamed_body_is_cut_off_once_past_the_limit(
    redis_url: str, key_prefix: str, path: str
) -> None:
    app = create_app(settings(redis_url, key_prefix))
    upload = Upload(HUGE)
    headers = [(b"transfer-encoding", b"chunked"), *auth_raw()]
    status, out_headers, body = call(app, path, headers, upload)
    assert status == 413, body
    assert upload.pulled <= DEFAULT_MAX_BODY_BYTES + upload.chunk
    assert out_headers[b"connection"] == b"close"
    assert "limit" in json.loads(body)["detail"]


def test_invalid_content_length_gets_400(redis_url: str, key_prefix: str) -> None:
    app = create_app(settings(redis_url, key_prefix))
    upload = Upload(10)
    status, _, body = call(app, "/v1/samples", [(b"content-length", b"12x"), *auth_raw()], upload)
    assert (status, upload.pulled) == (400, 0)
    assert "Content-Length" in json.loads(body)["detail"]


def test_middleware_refuses_a_limit_below_one() -> None:
    with pytest.raises(ValueError, match="max_body_bytes"):
        EdgeMiddleware(FastAPI(), max_body_bytes=0, api_token=None)


# --- through the real app with its lifespan -------------------------------------------------


@pytest.fixture
def client(redis_url: str, key_prefix: str) -> Iterator[TestClient]:
    with TestClient(create_app(settings(redis_url, key_prefix, max_body_bytes=4096))) as c:
        yield c


def test_body_limit_is_a_setting_and_bodies_within_it_are_served(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = samples(3)
    assert len(json.dumps(small)) < 4096
    assert client.post("/v1/samples", json=small, headers=AUTH).status_code == 202
    big = samples(40)
    assert len(json.dumps(big)) > 4096
    r = client.post("/v1/samples", json=big, headers=AUTH)
    assert r.status_code == 413
    assert "4096" in r.json()["detail"]
    monkeypatch.setenv("OOMCAST_MAX_BODY_BYTES", "12345")
    assert Settings().max_body_bytes == 12345
    monkeypatch.delenv("OOMCAST_MAX_BODY_BYTES")
    assert Settings().max_body_bytes == 8 * 1024 * 1024


@pytest.mark.parametrize(
    "value",
    [b"Bearer t\xc3\xb6k", b"Bearer t\xf6k", b"", b"Bearer", b"Token abc", b"bearer  x  "],
    ids=repr,
)
def test_any_authorization_header_is_a_401_never_a_500(client: TestClient, value: bytes) -> None:
    r = client.get("/v1/devices", headers={b"Authorization": value})
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert r.json()["detail"].startswith("missing or wrong bearer token")


def test_right_token_is_accepted_in_any_scheme_case(client: TestClient) -> None:
    for value in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER  {TOKEN} "):
        assert client.get("/v1/devices", headers={"Authorization": value}).status_code == 200
    assert client.get("/livez").status_code == 200  # health stays open
    assert client.get("/metrics").status_code == 200


def v1_operations(app: FastAPI) -> list[tuple[str, str]]:
    """(method, concrete path) of every /v1 operation the OpenAPI document lists."""
    out = []
    for path, item in app.openapi()["paths"].items():
        if path.startswith("/v1/"):
            concrete = path.replace("{node}", "n1").replace("{device}", "gpu0")
            out += [(method.upper(), concrete) for method in item]
    return out


def test_every_v1_endpoint_needs_the_token(client: TestClient) -> None:
    app: Any = client.app
    operations = v1_operations(app)
    assert len(operations) >= 6  # predict, samples, devices (2), alerts, rules
    for method, path in operations:
        body = samples(2) if method == "POST" else None
        r = client.request(method, path, json=body)
        assert r.status_code == 401, (method, path, r.text)
        assert r.headers["WWW-Authenticate"] == "Bearer"
        ok = client.request(method, path, json=body, headers=AUTH)
        assert ok.status_code != 401, (method, path)


def test_the_dependency_guards_v1_even_without_the_middleware(
    redis_url: str, key_prefix: str
) -> None:
    app = create_app(settings(redis_url, key_prefix))
    app.user_middleware = [
        m for m in app.user_middleware if getattr(m, "cls", None) is not EdgeMiddleware
    ]
    with TestClient(app) as c:
        assert c.get("/v1/devices").status_code == 401
        assert c.get("/v1/devices", headers={b"Authorization": b"Bearer t\xf6k"}).status_code == 401
        assert c.get("/v1/devices", headers=AUTH).status_code == 200


# --- the OpenAPI document ----------------------------------------------------------------


def test_openapi_declares_the_bearer_scheme_and_every_answer(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    schemes = doc["components"]["securitySchemes"]
    assert schemes["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": schemes["HTTPBearer"]["description"],
    }
    paths = doc["paths"]
    for path, item in paths.items():
        for method, op in item.items():
            if path.startswith("/v1/"):
                assert op["security"] == [{"HTTPBearer": []}], (method, path)
                assert "401" in op["responses"], (method, path)
            if method == "post":
                assert {"413", "422"} <= set(op["responses"]), (method, path)
    assert set(paths["/v1/samples"]["post"]["responses"]) >= {"202", "503"}
    assert "Retry-After" in paths["/v1/samples"]["post"]["responses"]["503"]["headers"]
    assert "404" in paths["/v1/devices/{node}/{device}"]["get"]["responses"]
    assert "503" in paths["/readyz"]["get"]["responses"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")


def test_an_empty_sample_breaks_the_documented_schema_and_its_422_matches_it(
    client: TestClient,
) -> None:
    doc = client.get("/openapi.json").json()
    body_ref = doc["paths"]["/v1/samples"]["post"]["requestBody"]["content"]["application/json"]
    root = {"components": doc["components"]}
    body_schema = {**root, **body_ref["schema"]}
    with pytest.raises(jsonschema_rs.ValidationError, match="required"):
        jsonschema_rs.validate(body_schema, {"samples": [{}]})
    jsonschema_rs.validate(body_schema, samples(2))  # a good body is valid
    r = client.post("/v1/samples", json={"samples": [{}]}, headers=AUTH)
    assert r.status_code == 422
    declared = doc["paths"]["/v1/samples"]["post"]["responses"]["422"]["content"]
    jsonschema_rs.validate({**root, **declared["application/json"]["schema"]}, r.json())
    bad_json = client.post("/v1/samples", content=b"{nope", headers=AUTH)
    assert bad_json.status_code == 422
    jsonschema_rs.validate({**root, **declared["application/json"]["schema"]}, bad_json.json())


# --- a real server: refusals come back at once, without waiting for the body ---------------


@pytest.fixture
def server(redis_url: str, key_prefix: str) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        create_app(settings(redis_url, key_prefix)), host="127.0.0.1", port=port, log_level="error"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    assert wait_until(lambda: srv.started, 20), "uvicorn did not start"
    yield port
    srv.should_exit = True
    thread.join(20)


def answer_to_headers_only(port: int, headers: str) -> int:
    """Send a request's head announcing a huge body, send none of it, return the status."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        head = (
            f"POST /v1/samples HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {HUGE}\r\n{headers}\r\n"
        )
        sock.sendall(head.encode())
        status_line = sock.recv(4096).split(b"\r\n", 1)[0]  # times out if the server waits
        return int(status_line.split()[1])


def test_real_server_answers_before_any_body_arrives(server: int) -> None:
    assert answer_to_headers_only(server, "") == 401
    assert answer_to_headers_only(server, f"Authorization: Bearer {TOKEN}\r\n") == 413


# --- back-pressure: Redis refusing writes ------------------------------------------------


def oom(r: redis.Redis) -> Callable[[], object]:
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)  # below what an empty server uses
    return lambda: r.config_set("maxmemory", 0)


def read_only(r: redis.Redis) -> Callable[[], object]:
    # A replica of a master that is not there keeps its data, answers reads, refuses writes.
    r.replicaof("127.0.0.1", free_port())
    return lambda: r.replicaof("NO", "ONE")


@pytest.mark.parametrize(
    ("refuse", "words"), [(oom, "out of memory"), (read_only, "read-only")], ids=["oom", "ro"]
)
def test_redis_refusing_writes_is_a_503_that_keeps_nothing(
    private_redis: PrivateRedis,
    key_prefix: str,
    refuse: Callable[[redis.Redis], Callable[[], object]],
    words: str,
) -> None:
    r = redis.Redis.from_url(private_redis.url)
    keys = Keys(key_prefix, 2)

    def stored() -> int:
        return sum(int(r.xlen(k)) for k in keys.all_samples())

    two_nodes = {"samples": samples(3, "n1")["samples"] + samples(2, "n2")["samples"]}
    with TestClient(create_app(settings(private_redis.url, key_prefix))) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        restore = refuse(r)
        answers: list[Any] = []

        def refused() -> bool:
            # Every answer is a 503 that keeps nothing. The first may say "unreachable":
            # REPLICAOF makes Redis close its clients' connections.
            resp = c.post("/v1/samples", json=two_nodes, headers=AUTH)
            assert resp.status_code == 503, resp.text
            assert int(resp.headers["Retry-After"]) > 0
            answers.append(resp.json()["detail"])
            return words in answers[-1]

        try:
            assert wait_until(refused, 10), answers
            assert "nothing was accepted" in answers[-1]
            assert len(answers[-1]) < 300  # the refused command (samples and all) is not echoed
            assert stored() == 0
            ready = c.get("/readyz")
            assert ready.status_code == 503
            status = ready.json()
            assert status["redis"] is True and status["redis_writable"] is False
            assert words in status["problem"]
            assert status["checks"]["redis_writable"] is False
        finally:
            restore()
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        assert c.post("/v1/samples", json=two_nodes, headers=AUTH).status_code == 202
        assert stored() == 2  # one entry per node: this request's, and nothing of the first


def test_the_token_is_checked_before_the_body_behind_a_root_path(
    redis_url: str, key_prefix: str
) -> None:
    """Behind a proxy that sets root_path the scope's path carries the prefix; the API
    below it is still guarded before any byte of the body is read."""
    app = create_app(settings(redis_url, key_prefix))
    with TestClient(app, root_path="/oomcast") as c:
        resp = c.post("/oomcast/v1/samples", content=b"{" * 100)
        assert resp.status_code == 401
        # the edge's refusal (it closes the connection rather than read the body), not the
        # route's own check after the body was parsed
        assert resp.headers.get("connection") == "close"
