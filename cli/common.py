"""What the ``oomcast`` subcommands share: the usage error, the Redis key layout from the
environment, stopping on SIGTERM / SIGINT, and the headers of a request to the service."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oomcast.model.wire import Keys

PROG = "oomcast"
REPO = Path(__file__).resolve().parents[1]
CORPUS_TRACES = REPO / "training" / "traces" / "corpus"  # the first, shorter runs
JOBS_TRACES = REPO / "training" / "traces" / "jobs"  # the corpus of real jobs
HOST_TRACES = REPO / "training" / "traces" / "host"
SHIPPED_MODEL = REPO / "model" / "oomcast-lstm.onnx"  # model/runtime.DEFAULT_MODEL, torch-free


class UsageError(Exception):
    """A mistake the user can fix; printed without a traceback."""


# The extra of pyproject.toml that installs each optional top-level module a command imports.
EXTRAS = {
    "torch": "train",
    "matplotlib": "train",
    "onnx": "train",
    "tqdm": "train",
    "onnxruntime": "onnx",
    "fastapi": "service",
    "uvicorn": "service",
    "pydantic": "collector",
    "pydantic_settings": "collector",
    "httpx": "service",
    "prometheus_client": "collector",  # in the service extra too; this one is lighter
    "yaml": "service",
    "pynvml": "collector",
    "rich": "demo",
}


# The parts of oomcast an image may leave out (the collector's carries neither the service
# nor the harnesses), and the extra of the image, or installation, that has them.
PARTS = {"oomcast.service": "service", "oomcast.bench": "demo", "oomcast.training": "train",
         "oomcast.preflight": "train"}  # fmt: skip


# Commands with an extra of their own for what they need (preflight: torch, without the
# training tools)
COMMAND_EXTRAS = {"preflight": "preflight"}


def missing_extra(module: str, command: str | None = None) -> str | None:
    """The extra that installs ``module`` (a dotted name is judged by its top level; one of
    oomcast's own parts, by the part), for ``command`` where it has an extra of its own."""
    parts = (
        extra for part, extra in PARTS.items() if module == part or module.startswith(part + ".")
    )
    found = next(parts, None) or EXTRAS.get(module.partition(".")[0])
    if found == "train" and command in COMMAND_EXTRAS:
        return COMMAND_EXTRAS[command]
    return found


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("oomcast")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def keys_from_env() -> Keys:
    from oomcast.model.wire import Keys

    try:
        return Keys.from_env()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def api_headers(token: str | None) -> dict[str, str]:
    """The headers of a request to the service's API: its token (``--token``, else
    ``OOMCAST_API_TOKEN``) as a bearer, when there is one (``oomcast top``, ``report``)."""
    token = token or os.environ.get("OOMCAST_API_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}
