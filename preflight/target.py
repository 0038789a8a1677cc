"""What a preflight is checked against: the GPU (or a capacity), the allocator settings, and
the report they head. Shared by ``preflight(job)`` and ``preflight_script``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomcast.preflight.allocconf import AllocConf, parse_alloc_conf
from oomcast.preflight.gpus import DEFAULT_CAPABILITY, capability_of, capacity_for
from oomcast.preflight.replay import Replay, Replayer
from oomcast.preflight.report import PreflightReport


@dataclass(frozen=True)
class Target:
    label: str  # the GPU's name, or the capacity given
    capacity_bytes: int  # what the caching allocator may reserve
    total_bytes: int | None  # the device's total, where a GPU was named
    conf: AllocConf

    @classmethod
    def resolve(
        cls,
        gpu: str | None,
        capacity_bytes: int | None,
        context_bytes: int,
        alloc_conf: str | AllocConf | None,
    ) -> Target:
        """``capacity_bytes`` wins; without it, the GPU's total less ``context_bytes``.
        ``alloc_conf`` is a ``PYTORCH_CUDA_ALLOC_CONF`` string or a parsed one."""
        label, capacity, total = capacity_for(gpu, capacity_bytes, context_bytes)
        conf = alloc_conf if isinstance(alloc_conf, AllocConf) else parse_alloc_conf(alloc_conf)
        return cls(label, capacity, total, conf)

    @property
    def device_bytes(self) -> int:
        """The device's memory as a traced script asks for it: the GPU's total, or the
        capacity where none was named."""
        return self.total_bytes or self.capacity_bytes

    @property
    def capability(self) -> tuple[int, int]:
        """The named GPU's compute capability (an A100's where none was named)."""
        return capability_of(self.label) or DEFAULT_CAPABILITY

    def replayer(self, conf: AllocConf | None = None) -> Replayer:
        return Replayer(self.capacity_bytes, conf or self.conf, self.total_bytes)

    def report(self, *, replay: Replay, **fields: Any) -> PreflightReport:
        """A report on this target, with the notes every report about it carries."""
        report = PreflightReport(
            gpu=self.label,
            capacity_bytes=self.capacity_bytes,
            total_bytes=self.total_bytes,
            alloc_conf=self.conf.to_string(),
            replay=replay,
            **fields,
        )
        for key in self.conf.ignored():
            report.notes.append(f"{key} is accepted but not modelled (see docs/preflight.md)")
        return report
