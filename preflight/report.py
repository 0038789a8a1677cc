"""The preflight report: the figures, the verdict and the remedies, as text and as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oomcast.preflight.remedies import Remedy
from oomcast.preflight.replay import Replay
from oomcast.training.allocator import format_size


@dataclass
class PreflightReport:
    job: str
    gpu: str
    capacity_bytes: int
    total_bytes: int | None
    alloc_conf: str
    batch_size: int
    device: str  # the device type the capture ran on (cpu where torch has no CUDA)
    steps: int
    replay: Replay
    remedies: list[Remedy] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.replay.fits

    def verdict_text(self) -> str:
        oom = self.replay.oom
        if oom is None:
            return f"fits: peak reserved {format_size(self.replay.peak_reserved_bytes)}"
        where = (
            "while loading the model and its state (before step 0)"
            if oom.step < 0
            else f"at phase {oom.phase} of step {oom.step}"
        )
        module = f" in {oom.module}" if oom.module else ""
        cached = oom.reserved_bytes - oom.allocated_bytes
        live = oom.allocated_bytes / self.capacity_bytes if self.capacity_bytes else 0.0
        if oom.fragmented:
            why = (
                f"; the cache held {format_size(cached)} free, but in pieces too small for it:"
                " fragmentation (expandable_segments:True lets segments grow instead)"
            )
            if live >= 0.9:
                why += f", though live tensors alone take {live:.0%} of the capacity"
        else:
            why = "; live tensors fill the GPU"
        return (
            f"OOM {where}{module}: a request of {format_size(oom.requested_bytes)} failed with"
            f" {format_size(oom.reserved_bytes)} reserved and"
            f" {format_size(oom.allocated_bytes)} allocated{why}"
        )

    def to_json(self) -> dict[str, Any]:
        r = self.replay
        oom = r.oom
        return {
            "job": self.job,
            "gpu": self.gpu,
            "capacity_bytes": self.capacity_bytes,
            "alloc_conf": self.alloc_conf,
            "batch_size": self.batch_size,
            "capture_device": self.device,
            "phases": [
                {
                    "step": p.step,
                    "phase": p.phase,
                    "peak_allocated_bytes": p.peak_allocated_bytes,
                    "peak_reserved_bytes": p.peak_reserved_bytes,
                }
                for p in r.phases
            ],
            "peak_allocated_bytes": r.peak_allocated_bytes,
            "peak_reserved_bytes": r.peak_reserved_bytes,
            "headroom_bytes": r.headroom_bytes,
            "cached_free_frac": round(r.cached_free_frac, 4),
            "verdict": {
                "fits": oom is None,
                "phase": None if oom is None else oom.phase,
                "step": None if oom is None else oom.step,
                "requested_bytes": None if oom is None else oom.requested_bytes,
                "reserved_bytes": None if oom is None else oom.reserved_bytes,
                "allocated_bytes": None if oom is None else oom.allocated_bytes,
                "fragmented": None if oom is None else oom.fragmented,
            },
            "remedies": [m.to_json() for m in self.remedies],
            "notes": list(self.notes),
        }

    def text(self) -> str:
        r = self.replay
        cap = format_size(self.capacity_bytes)
        lines = [
            f"preflight {self.job} (batch {self.batch_size}) on {self.gpu}: capacity {cap}"
            f" for the allocator, alloc conf {self.alloc_conf}",
            "",
            f"  {'step':>4}  {'phase':<11} {'peak allocated':>15} {'peak reserved':>15}",
        ]
        for p in r.phases:
            step = "-" if p.step < 0 else str(p.step)
            lines.append(
                f"  {step:>4}  {p.phase:<11} {format_size(p.peak_allocated_bytes):>15}"
                f" {format_size(p.peak_reserved_bytes):>15}"
            )
        sign = "" if r.headroom_bytes >= 0 else "-"
        lines += [
            "",
            f"peak allocated {format_size(r.peak_allocated_bytes)}, peak reserved"
            f" {format_size(r.peak_reserved_bytes)}, headroom {sign}"
            f"{format_size(abs(r.headroom_bytes))}; when reserved peaked, {r.cached_free_frac:.1%}"
            " of it was cache freed by earlier phases and kept for reuse (not fragmentation"
            " unless a request fails for want of one block: the verdict says)",
            f"verdict: {self.verdict_text()}",
        ]
        if self.remedies:
            lines += ["", "remedies (each re-run through capture and replay):"]
            for m in self.remedies:
                mark = "fits" if m.fits else "does not fit"
                lines.append(
                    f"  {m.name:<20} {m.change}: peak reserved"
                    f" {format_size(m.peak_reserved_bytes)}, {mark}"
                )
        if self.notes:
            lines += ["", *[f"note: {n}" for n in self.notes]]
        return "\n".join(lines)
