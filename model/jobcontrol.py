"""The job-control protocol: how the node agent asks a training job to checkpoint, and how
the job's in-process hook answers (one definition, used by both sides).

**Request**: an entry on the job's control stream :func:`jobctl_key`
(``{prefix}:jobctl:{<job>}``; the hash tag keeps it in one Redis Cluster slot) with one
field, ``cmd``: a JSON object ``{"action": "checkpoint", "id": "...", "reason": "..."}``
(:func:`encode_jobctl`, :func:`parse_jobctl`).

**Answers**: events on the events stream, with the request id in extra keys (event readers
ignore keys they do not know): ``checkpoint_requested`` (``request_id``, ``reason``,
``source``) when the hook takes the request, then ``checkpoint_done`` or
``checkpoint_failed`` (``request_id``, ``path``, and ``request_ids`` when one checkpoint
answers several requests) once the job has saved, or failed to (:func:`ack_extra`,
:func:`answers_request`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oomcast.model.schema import SchemaError, decode_json
from oomcast.model.text import compact_json

CHECKPOINT = "checkpoint"  # the one action a job's hook takes today
CHECKPOINT_REQUESTED = "checkpoint_requested"
CHECKPOINT_DONE = "checkpoint_done"
CHECKPOINT_FAILED = "checkpoint_failed"
FINAL_EVENTS = (CHECKPOINT_DONE, CHECKPOINT_FAILED)
ANSWER_EVENTS = (CHECKPOINT_REQUESTED, *FINAL_EVENTS)


def jobctl_key(prefix: str, job: str) -> str:
    """The stream of commands for one job; the hash tag keeps it in one Redis Cluster slot."""
    return f"{prefix}:jobctl:{{{job}}}"


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True, slots=True)
class JobCommand:
    action: str
    id: str
    reason: str | None = None


def encode_jobctl(
    action: str = CHECKPOINT, id: str | None = None, reason: str | None = None
) -> dict[str, str]:
    """The fields of a job control entry, for XADD (what :func:`parse_jobctl` reads)."""
    cmd: dict[str, str] = {"action": action, "id": id or new_request_id()}
    if reason is not None:
        cmd["reason"] = reason
    return {"cmd": compact_json(cmd)}


def parse_jobctl(fields: Mapping[Any, Any]) -> JobCommand:
    """Decode one entry of a job control stream (see the module docstring). Every command
    goes through here, so this is where a signature check belongs. Raises SchemaError."""
    raw = fields.get("cmd", fields.get(b"cmd"))
    if raw is None:
        raise SchemaError("cmd", "entry has no 'cmd' field")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode()
        except UnicodeDecodeError:
            raise SchemaError("cmd", "is not UTF-8") from None
    obj = decode_json(raw, "cmd")
    if not isinstance(obj, dict):
        raise SchemaError("cmd", f"must be a JSON object, got {type(obj).__name__}")
    action = obj.get("action")
    if not isinstance(action, str) or not action:
        raise SchemaError("cmd.action", f"must be a non-empty string, got {action!r}")
    cid = obj.get("id")
    if cid is None:
        cid = new_request_id()
    elif isinstance(cid, int) and not isinstance(cid, bool):
        cid = str(cid)
    elif not isinstance(cid, str) or not cid:
        raise SchemaError("cmd.id", f"must be a non-empty string, got {cid!r}")
    reason = obj.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise SchemaError("cmd.reason", f"must be a string, got {reason!r}")
    return JobCommand(action=action, id=cid, reason=reason)


def ack_extra(request_ids: Sequence[str], path: str | None) -> dict[str, Any]:
    """The extra keys of a ``checkpoint_done`` / ``checkpoint_failed`` event answering
    ``request_ids`` (oldest first; none when the job saved unasked)."""
    extra: dict[str, Any] = {
        "request_id": request_ids[0] if request_ids else None,
        "path": None if path is None else str(path),
    }
    if len(request_ids) > 1:
        extra["request_ids"] = list(request_ids)
    return extra


def answers_request(obj: Mapping[str, Any], request_id: str) -> bool:
    """Whether event ``obj`` (a decoded event dict) names ``request_id``."""
    if obj.get("request_id") == request_id:
        return True
    ids = obj.get("request_ids")
    return isinstance(ids, list) and request_id in ids


def event_object(fields: Any) -> dict[str, Any] | None:
    """An events-stream entry as its whole event dict, extra keys included (the answers
    live there), or None when it is not one."""
    raw = fields.get("event", fields.get(b"event")) if isinstance(fields, dict) else None
    if raw is None:
        return None
    try:
        obj = decode_json(raw, "event")
    except SchemaError:
        return None
    return obj if isinstance(obj, dict) else None


__all__ = [
    "ANSWER_EVENTS",
    "CHECKPOINT",
    "CHECKPOINT_DONE",
    "CHECKPOINT_FAILED",
    "CHECKPOINT_REQUESTED",
    "FINAL_EVENTS",
    "JobCommand",
    "ack_extra",
    "answers_request",
    "encode_jobctl",
    "event_object",
    "jobctl_key",
    "new_request_id",
    "parse_jobctl",
]
