"""What the ``oomcast`` subcommands share: the usage error, the Redis key layout from the
environment, and stopping on SIGTERM / SIGINT."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oomcast.model.wire import Keys

PROG = "oomcast"
REPO = Path(__file__).resolve().parents[1]
CORPUS_TRACES = REPO / "training" / "traces" / "corpus"
HOST_TRACES = REPO / "training" / "traces" / "host"


class UsageError(Exception):
    """A mistake the user can fix; printed without a traceback."""


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
