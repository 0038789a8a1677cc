"""oomcast preflight: will a training job fit a GPU, and in which phase would it not?

The job's own code runs a few train steps, one eval and one checkpoint with tensors that
take no memory (fake tensors), the allocation stream of each phase is replayed through the
caching-allocator simulator (``oomcast.training.allocator``) at the target GPU's capacity
and allocator settings, and the report says the peak of each phase, the verdict and what
would make it fit. Needs torch (``pip install 'oomcast[train]'``). See docs/preflight.md.
"""

from __future__ import annotations

from typing import Any

from oomcast.preflight.api import preflight
from oomcast.preflight.job import CheckpointMode, PreflightJob
from oomcast.preflight.report import PreflightReport
from oomcast.preflight.session import PreflightSubmitted, submit

_CALLBACKS = ("PreflightLightningCallback", "PreflightOOM", "PreflightTrainerCallback")


def __getattr__(name: str) -> Any:
    """The framework callbacks (``preflight/callbacks.py``), imported on first use."""
    if name in _CALLBACKS:
        from oomcast.preflight import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointMode",
    "PreflightJob",
    "PreflightLightningCallback",
    "PreflightOOM",
    "PreflightReport",
    "PreflightSubmitted",
    "PreflightTrainerCallback",
    "preflight",
    "submit",
]
