"""Proof on the node: before a live shed, the agent measures the domain itself.

A valid signature proves that the service sent a command, not that the memory state behind
its forecast was real: anyone who can write to Redis can add forged samples, and the service
forecasts from whatever it reads. So before a live shed (the one action that can lose work,
``model.control.DESTRUCTIVE_ACTIONS``) the node agent reads the domain with its own eyes (a
GPU through NVML, a ``cgroup:<path>`` domain from the cgroup's files) and acts only when
that reading confirms the danger the command claims. The command's ``forecast`` carries
``used_bytes`` and ``total_bytes`` of the sample the alert was made from; the claim is
confirmed when

* the measured capacity is the claimed one, within :data:`CAPACITY_TOLERANCE` of it (a
  forged sample of a "smaller GPU" does not pass), and
* the measured used fraction is at least the claimed one less ``tolerance`` (default
  :data:`DEFAULT_TOLERANCE`, 5 percentage points: use drifts between the sample and the
  command, and a domain genuinely filling up only rises).

A domain the agent cannot measure (a replayed trace, a GPU NVML no longer answers for, a
cgroup without a limit) is not confirmed, nor is a command that claims no figures. Dry runs
act on nothing, and a checkpoint only asks a job to save its work, so neither needs proof.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomcast.model.control import Command

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 0.05  # of the capacity: 5 percentage points of used fraction
CAPACITY_TOLERANCE = 0.02  # relative: measured and claimed capacity must agree this well


@dataclass(frozen=True, slots=True)
class Measurement:
    """One reading of a domain by the agent: bytes in use and capacity."""

    used_bytes: int
    total_bytes: int

    @property
    def used_frac(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes > 0 else 0.0


Measure = Callable[[Command], Measurement | None]


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a command's claim was confirmed; ``details`` go into its audit event."""

    confirmed: bool
    message: str
    details: dict[str, Any]


def _claimed(forecast: dict[str, Any]) -> tuple[float, float] | None:
    used, total = forecast.get("used_bytes"), forecast.get("total_bytes")
    for v in (used, total):
        if isinstance(v, bool) or not isinstance(v, int | float):
            return None
        try:
            if not math.isfinite(float(v)):
                return None
        except OverflowError:
            return None
    assert isinstance(used, int | float) and isinstance(total, int | float)
    if total <= 0 or used < 0:
        return None
    return float(used), float(total)


def check_claim(
    cmd: Command,
    measure: Measure | None,
    tolerance: float = DEFAULT_TOLERANCE,
    capacity_tolerance: float = CAPACITY_TOLERANCE,
) -> Verdict:
    """Measure ``cmd``'s domain and compare with what its forecast claims (module docstring)."""
    details: dict[str, Any] = {"tolerance_pp": round(tolerance * 100, 3)}
    claim = _claimed(cmd.forecast)
    if claim is None:
        return Verdict(
            False, "the command claims no used_bytes/total_bytes for its domain", details
        )
    used, total = claim
    details["claimed"] = {
        "used_bytes": int(used),
        "total_bytes": int(total),
        "used_frac": round(used / total, 4),
    }
    reading: Measurement | None = None
    if measure is not None:
        try:
            reading = measure(cmd)
        except Exception as exc:  # a reader that breaks measures nothing
            log.warning("control: measuring %s failed: %s", cmd.device, exc)
    if reading is None or reading.total_bytes <= 0:
        return Verdict(False, f"{cmd.device} cannot be measured on this node", details)
    details["measured"] = {
        "used_bytes": reading.used_bytes,
        "total_bytes": reading.total_bytes,
        "used_frac": round(reading.used_frac, 4),
    }
    if abs(reading.total_bytes - total) > capacity_tolerance * total:
        return Verdict(
            False,
            f"{cmd.device} has a capacity of {reading.total_bytes} bytes here, the command"
            f" claims {int(total)}",
            details,
        )
    if reading.used_frac < used / total - tolerance:
        return Verdict(
            False,
            f"{cmd.device} is {reading.used_frac:.1%} used here, the command claims"
            f" {used / total:.1%} (tolerance {tolerance * 100:g} points)",
            details,
        )
    return Verdict(True, "confirmed by the agent's own reading", details)


def make_measure(
    *,
    nvml: Any | None = None,
    cgroup_root: Path | str | None = None,
    sim: Any | None = None,
) -> Measure:
    """The agent's ``measure``: a GPU through the NVML source (``NvmlSource.measure``, a fresh
    NVML query), a ``cgroup:<path>`` domain from that cgroup's files under ``cgroup_root``
    (``MemoryCgroup.read()``, its limit as the capacity), a simulated GPU from the simulator
    (``SimSource.measure``: it is that device). Anything else is not measurable: None."""

    def measure(cmd: Command) -> Measurement | None:
        if cmd.device.startswith("cgroup:"):
            if cgroup_root is None:
                return None
            return measure_cgroup(Path(cgroup_root), cmd.device[len("cgroup:") :])
        for source in (nvml, sim):
            got = source.measure(cmd.device) if source is not None else None
            if got is not None:
                return Measurement(int(got[0]), int(got[1]))
        return None

    return measure


def measure_cgroup(root: Path, rel: str) -> Measurement | None:
    """Usage and limit of the cgroup ``rel`` below ``root``; None where there is no such
    cgroup, it has no limit, or ``rel`` climbs out of ``root``."""
    from oomcast.collectors.cgroupfs import CgroupError, CgroupUnavailable, MemoryCgroup

    rel = rel.strip("/")
    if not rel or ".." in Path(rel).parts:
        return None
    try:
        cg = MemoryCgroup(root / rel, shared_reset=False)
        reading = cg.read(reset_peak=False)
    except (OSError, CgroupError, CgroupUnavailable, ValueError):
        return None
    if reading.limit_bytes is None or reading.limit_bytes <= 0:
        return None
    return Measurement(reading.usage_bytes, reading.limit_bytes)


__all__ = [
    "CAPACITY_TOLERANCE",
    "DEFAULT_TOLERANCE",
    "Measure",
    "Measurement",
    "Verdict",
    "check_claim",
    "make_measure",
    "measure_cgroup",
]
