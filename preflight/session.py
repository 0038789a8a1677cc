"""Script mode: a training script hands its job to preflight with :func:`submit`.

``oomcast preflight --gpu H100-80GB -- python train.py ARGS`` runs ``train.py`` in this
process (``runpy``, with ``sys.argv`` set to ``train.py ARGS``) inside a :class:`Session`.
When the script calls ``submit(job)``, the session runs the preflight with the command's
options, keeps the report and stops the script (by raising :class:`PreflightSubmitted`, a
``BaseException`` so that a script's ``except Exception`` does not swallow it) before it
trains.

Outside ``oomcast preflight``, ``submit(job)`` runs a preflight, prints the report to stderr
and returns it; the script goes on (to stop on a bad verdict, test ``report.fits``). The
GPU is ``gpu=`` if given, else ``$OOMCAST_PREFLIGHT_GPU``, else this machine's first CUDA
device (its total memory less the context allowance).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from oomcast.preflight.job import PreflightJob
from oomcast.preflight.report import PreflightReport

GPU_ENV = "OOMCAST_PREFLIGHT_GPU"


class PreflightSubmitted(BaseException):  # a signal, not an error
    """Raised by :func:`submit` inside a session to stop the script before it trains."""


@dataclass
class Session:
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of preflight()
    report: PreflightReport | None = None


_active: list[Session] = []


@contextmanager
def session(**options: Any) -> Iterator[Session]:
    """Install a session: ``submit`` inside it preflights with ``options`` and stops."""
    s = Session(options)
    _active.append(s)
    try:
        yield s
    finally:
        _active.remove(s)


def _local_capacity(context_bytes: int) -> int:
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"submit() outside `oomcast preflight` needs a GPU to check against: pass gpu=...,"
            f" set ${GPU_ENV}, or run on a machine with a CUDA device"
        )
    total: int = torch.cuda.get_device_properties(0).total_memory
    return total - context_bytes


def submit(job: PreflightJob, **options: Any) -> PreflightReport:
    """Hand ``job`` to preflight (see the module docstring for the two behaviours)."""
    from oomcast.preflight.api import preflight
    from oomcast.preflight.gpus import CONTEXT_ALLOWANCE_BYTES

    if not isinstance(job, PreflightJob):
        raise TypeError(f"submit() takes a PreflightJob, not {type(job).__name__}")
    if _active:
        s = _active[-1]
        s.report = preflight(job, **{**s.options, **options})
        raise PreflightSubmitted
    if "gpu" not in options and "capacity_bytes" not in options:
        env = os.environ.get(GPU_ENV)
        if env:
            options["gpu"] = env
        else:
            context = options.get("context_bytes", CONTEXT_ALLOWANCE_BYTES)
            options["capacity_bytes"] = _local_capacity(context)
    report = preflight(job, **options)
    print(report.text(), file=sys.stderr)
    return report
