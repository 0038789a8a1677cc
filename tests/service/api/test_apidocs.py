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
    assert "<link" not in text
    assert not re.search(r"https?://", text)
    for path, item in doc["paths"].items():  # every endpoint and schema is on the page
        assert f"<code>{path}</code>" in text
        for method in item:
            assert f'id="{method}-{path}"' in text
    for name in doc["components"]["schemas"]:
        assert f'id="schema-{name}"' in text
