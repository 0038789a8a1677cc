"""A script may describe its job itself and hand it over with :func:`submit` (optional: a
script as written is checked without it, ``preflight/script.py``).

Under ``oomcast preflight --gpu H100-80GB -- python train.py ARGS`` the script runs inside
a :class:`Session`. When it calls ``submit(job)``, the session keeps the job and stops the
script (by raising :class:`PreflightSubmitted`, a ``BaseException`` so that a script's
``except Exception`` does not swallow it) before it trains; the job is then checked with the
command's options.

Outside ``oomcast preflight``, ``submit(job)`` runs a preflight, prints the report to stderr
and returns it; the script goes on (to stop on a bad verdict, test ``report.fits``). The
GPU is ``gpu=`` if given, else ``$OOMCAST_PREFLIGHT_GPU``, else this machine's first CUDA
device (its total memory less the context allowance). With none of them (a laptop, a CI
runner) it prints one line saying so and returns None: running the script normally must not
fail because of preflight.
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
    job: PreflightJob | None = None  # what the script submitted


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


def _local_capacity(context_bytes: int) -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    total: int = torch.cuda.get_device_properties(0).total_memory
    return total - context_bytes


def submit(job: PreflightJob, **options: Any) -> PreflightReport | None:
    """Hand ``job`` to preflight (see the module docstring for the two behaviours)."""
    from oomcast.preflight.api import preflight
    from oomcast.preflight.gpus import CONTEXT_ALLOWANCE_BYTES

    if not isinstance(job, PreflightJob):
        raise TypeError(f"submit() takes a PreflightJob, not {type(job).__name__}")
    if _active:
        s = _active[-1]
        s.job = job
        s.options = {**s.options, **options}
        raise PreflightSubmitted
    if "gpu" not in options and "capacity_bytes" not in options:
        env = os.environ.get(GPU_ENV)
        if env:
            options["gpu"] = env
        else:
            context = options.get("context_bytes", CONTEXT_ALLOWANCE_BYTES)
            capacity = _local_capacity(context)
            if capacity is None:
                print(
                    f"oomcast preflight: no GPU to check {job.name} against (pass gpu=..., set"
                    f" ${GPU_ENV} or run on a CUDA machine); skipped",
                    file=sys.stderr,
                )
                return None
            options["capacity_bytes"] = capacity
    report = preflight(job, **options)
    print(report.text(), file=sys.stderr)
    return report
