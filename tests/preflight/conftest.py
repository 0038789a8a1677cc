"""Makes ``preflight_jobs`` (the jobs these tests share) importable, and the CLI's
``--entry preflight_jobs:...`` targets with it."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
