"""``GET /docs``: the API reference as one self-contained HTML page, made from the service's
own OpenAPI document. FastAPI's default page loads Swagger UI from a CDN, which shows
nothing on a cluster without internet; this one has no script and no external asset, so it
works wherever the service does. The machine-readable document stays at ``/openapi.json``.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

router = APIRouter()

METHODS = ("get", "post", "put", "patch", "delete")
STYLE = """
body{font:15px/1.45 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;
color:#1d2330}
h1{margin-bottom:.2rem}h2{border-bottom:1px solid #ccd;padding-bottom:.2rem;margin-top:2.2rem}
code,pre{font:13px ui-monospace,monospace;background:#f2f3f7;border-radius:4px}
code{padding:0 .25rem}pre{padding:.6rem;overflow-x:auto}
.op{border:1px solid #dde;border-radius:6px;padding:.2rem 1rem .6rem;margin:1rem 0}
.m{display:inline-block;min-width:3.6rem;font-weight:600;text-transform:uppercase}
.get{color:#176b34}.post{color:#1f4fa3}.delete{color:#a32a1f}
table{border-collapse:collapse;margin:.4rem 0}td,th{border:1px solid #dde;padding:.2rem .5rem;
text-align:left;vertical-align:top}
"""


def _e(text: object) -> str:
    return html.escape(str(text))


def _md(text: object) -> str:
    """Escaped prose with its code spans (double backticks in docstrings, single ones in
    descriptions) as code."""
    return re.sub(r"``([^`]+)``|`([^`]+)`", lambda m: f"<code>{m[1] or m[2]}</code>", _e(text))


def _type(schema: dict[str, Any]) -> str:
    """A schema's type in a few words, with links to named schemas."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f'<a href="#schema-{_e(name)}">{_e(name)}</a>'
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " | ".join(_type(s) for s in schema[key])
    kind = schema.get("type", "any")
    if "enum" in schema:
        return " | ".join(f"<code>{_e(json.dumps(v))}</code>" for v in schema["enum"])
    if isinstance(kind, list):  # JSON Schema 2020-12: ["integer", "null"]
        return " | ".join(_type({**schema, "type": k}) for k in kind)
    if kind == "object" and "properties" in schema:
        return "object (its fields below)"
    if kind == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        return f"object of {_type(extra) if isinstance(extra, dict) else 'any'}"
    return _e(kind)


def _parameters(op: dict[str, Any]) -> str:
    params = op.get("parameters", [])
    if not params:
        return ""
    rows = "".join(
        f"<tr><td><code>{_e(p['name'])}</code></td><td>{_e(p.get('in', ''))}</td>"
        f"<td>{_type(p.get('schema', {}))}</td><td>{'yes' if p.get('required') else ''}</td>"
        f"<td>{_md(p.get('description', ''))}</td></tr>"
        for p in params
    )
    head = "<tr><th>parameter</th><th>in</th><th>type</th><th>required</th><th></th></tr>"
    return f"<table>{head}{rows}</table>"


def _body(op: dict[str, Any], schemas: dict[str, Any]) -> str:
    """The request body: its type, and the fields of the schema it names, in place."""
    out = []
    for media, spec in op.get("requestBody", {}).get("content", {}).items():
        schema = spec.get("schema", {})
        out.append(f"<p>Body (<code>{_e(media)}</code>): {_type(schema)}</p>")
        named = schemas.get(schema.get("$ref", "").rsplit("/", 1)[-1], schema)
        out.append(_fields(named))
    return "".join(out)


def _fields(schema: dict[str, Any]) -> str:
    """A table of an object's fields; a field that is an object, or a list of objects,
    with fields of its own gets their table after it; then the schema's example."""
    required = set(schema.get("required", []))
    props = schema.get("properties", {})
    if not props:
        return ""
    rows, nested = [], []
    for k, v in props.items():
        rows.append(
            f"<tr><td><code>{_e(k)}</code></td><td>{_type(v)}</td>"
            f"<td>{'yes' if k in required else ''}</td><td>{_md(v.get('description', ''))}"
            f"</td></tr>"
        )
        kinds = v.get("type")
        is_list = kinds == "array" or (isinstance(kinds, list) and "array" in kinds)
        inner = v.get("items", {}) if is_list else v
        if inner.get("properties"):
            each = "each item of " if inner is not v else ""
            nested.append(f"<p>{each}<code>{_e(k)}</code>:</p>{_fields(inner)}")
        for x in v.get("examples", []):
            nested.append(f"<p>Example of <code>{_e(k)}</code>:</p>")
            nested.append(f"<pre>{_e(json.dumps(x, indent=1))}</pre>")
    head = "<tr><th>field</th><th>type</th><th>required</th><th></th></tr>"
    examples = schema.get("examples") or ([schema["example"]] if "example" in schema else [])
    shown = "".join(f"<p>Example:</p><pre>{_e(json.dumps(x, indent=1))}</pre>" for x in examples)
    return f"<table>{head}{''.join(rows)}</table>{''.join(nested)}{shown}"


def _responses(op: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{_e(code)}</td><td>{_md(r.get('description', ''))}</td></tr>"
        for code, r in op.get("responses", {}).items()
    )
    return f"<table><tr><th>status</th><th>meaning</th></tr>{rows}</table>" if rows else ""


def _operation(path: str, method: str, op: dict[str, Any], schemas: dict[str, Any]) -> str:
    summary = op.get("summary", "")
    about = op.get("description", "")
    return (
        f'<div class="op" id="{_e(method)}-{_e(path)}"><h3><span class="m {method}">'
        f"{_e(method)}</span> <code>{_e(path)}</code> {_e(summary)}</h3>"
        f"<p>{_md(about)}</p>{_parameters(op)}{_body(op, schemas)}{_responses(op)}</div>"
    )


def _schema(name: str, schema: dict[str, Any]) -> str:
    table = _fields(schema) or f"<pre>{_e(json.dumps(schema, indent=1))}</pre>"
    about = _md(schema.get("description", ""))
    return f'<h3 id="schema-{_e(name)}">{_e(name)}</h3><p>{about}</p>{table}'


def render(doc: dict[str, Any]) -> str:
    """The whole reference page of an OpenAPI document."""
    info = doc.get("info", {})
    ops = [
        (path, method, item[method])
        for path, item in doc.get("paths", {}).items()
        for method in METHODS
        if method in item
    ]
    toc = "".join(
        f'<li><a href="#{_e(m)}-{_e(p)}"><span class="m {m}">{_e(m)}</span> {_e(p)}</a></li>'
        for p, m, _ in ops
    )
    schemas = doc.get("components", {}).get("schemas", {})
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        # an empty icon: otherwise the browser asks for /favicon.ico, a 404 in its console
        '<link rel=icon href="data:,">'
        f"<title>{_e(info.get('title'))}"
        f" API</title><style>{STYLE}</style></head><body><h1>{_e(info.get('title'))} API"
        f" {_e(info.get('version', ''))}</h1><p>{_md(info.get('summary', ''))} The OpenAPI"
        ' document: <a href="/openapi.json">/openapi.json</a>.</p>'
        f"<ul>{toc}</ul><h2>Endpoints</h2>{''.join(_operation(*o, schemas) for o in ops)}"
        f"<h2>Schemas</h2>{''.join(_schema(n, s) for n, s in schemas.items())}</body></html>"
    )


@router.get("/docs", include_in_schema=False)
def docs(request: Request) -> HTMLResponse:
    return HTMLResponse(render(request.app.openapi()))
