"""``/docs`` works offline: FastAPI's default page loaded Swagger UI from a CDN and showed a
blank page on a cluster without internet."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from oomcast.service.main import create_app
from oomcast.service.settings import Settings


def test_the_api_reference_needs_nothing_from_outside(redis_url: str, key_prefix: str) -> None:
    app = create_app(Settings(redis_url=redis_url, key_prefix=key_prefix))
    with TestClient(app) as c:
        page = c.get("/docs")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        text = page.text
        doc = c.get("/openapi.json").json()
        assert c.get("/redoc").status_code == 404  # the other CDN page is off too
    # no script at all, and nothing fetched from anywhere: no src=, no stylesheet link
    assert "<script" not in text and not re.search(r"\bsrc\s*=", text)
    # the one link is an empty icon, so the browser does not ask for /favicon.ico (a 404)
    assert re.findall(r"<link[^>]*>", text) == ['<link rel=icon href="data:,">']
    assert not re.search(r"https?://", text)
    for path, item in doc["paths"].items():  # every endpoint and schema is on the page
        assert f"<code>{path}</code>" in text
        for method in item:
            assert f'id="{method}-{path}"' in text
    for name in doc["components"]["schemas"]:
        assert f'id="schema-{name}"' in text


def test_a_request_body_shows_its_fields_and_an_example_and_code_reads_as_code(
    redis_url: str, key_prefix: str
) -> None:
    with TestClient(create_app(Settings(redis_url=redis_url, key_prefix=key_prefix))) as c:
        text = c.get("/docs").text
    start = text.index('id="post-/v1/samples"')
    section = text[start : text.index('<div class="op"', start + 1)]
    # the sample's own fields, in place, not "array of object of any"
    for field in ("ts", "node", "device", "kind", "total_bytes", "used_bytes", "processes"):
        assert f"<td><code>{field}</code></td>" in section, field
    assert "object of any" not in section
    assert "each item of <code>processes</code>" in section  # nested lists of objects too
    assert "Example of <code>samples</code>" in section and "&quot;used_bytes&quot;" in section
    # `code` in descriptions is shown as code, never as raw backticks
    assert "<code>Authorization: Bearer</code>" in section
    body = text[text.index("<body>") :]
    assert "`" not in re.sub(r"<pre>.*?</pre>", "", body, flags=re.S)
