"""The preflight command's tests name jobs of ``tests/preflight/preflight_jobs.py`` as
``--entry preflight_jobs:...``: that folder goes on the path, as there."""

from __future__ import annotations

import sys
from pathlib import Path

JOBS = str(Path(__file__).resolve().parents[1] / "preflight")
if JOBS not in sys.path:
    sys.path.insert(0, JOBS)
