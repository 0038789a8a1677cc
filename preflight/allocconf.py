"""``PYTORCH_CUDA_ALLOC_CONF``-style allocator settings: parse, check, print.

The string is ``key:value`` pairs separated by commas, as torch reads the environment
variable. Modelled by the replay: ``expandable_segments``, ``max_split_size_mb``,
``max_non_split_rounding_mb``. Accepted and not modelled: ``garbage_collection_threshold``
(it only acts when ``set_per_process_memory_fraction`` is set, and it only releases cached
blocks earlier than the allocator's own release-and-retry before an OOM does, so it can lower
reserved bytes but never turns an OOM into a fit or back: the verdict stands and peak reserved
is an upper bound), ``roundup_power2_divisions`` (the simulator rounds to 512 B only) and
``backend`` (``native`` only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MIB = 1 << 20
_MODELLED = ("expandable_segments", "max_split_size_mb", "max_non_split_rounding_mb")
_IGNORED = ("garbage_collection_threshold", "roundup_power2_divisions", "backend")


class AllocConfError(ValueError):
    """A bad allocator setting; the message names the key and the value."""


@dataclass(frozen=True)
class AllocConf:
    expandable_segments: bool = False
    max_split_size_mb: int | None = None
    max_non_split_rounding_mb: int = 20
    garbage_collection_threshold: float | None = None
    roundup_power2_divisions: str | None = None

    def to_string(self) -> str:
        parts = [f"expandable_segments:{self.expandable_segments}"]
        if self.max_split_size_mb is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_mb}")
        if self.max_non_split_rounding_mb != 20:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_mb}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.roundup_power2_divisions is not None:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        return ",".join(parts)

    def with_expandable(self) -> AllocConf:
        return replace(self, expandable_segments=True)

    def ignored(self) -> list[str]:
        """Settings given that the replay does not model (for the report)."""
        out = []
        if self.garbage_collection_threshold is not None:
            out.append("garbage_collection_threshold")
        if self.roundup_power2_divisions is not None:
            out.append("roundup_power2_divisions")
        return out


def _mib(key: str, raw: str, least: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise AllocConfError(f"{key} must be a whole number of MiB, not {raw!r}") from None
    if value < least:
        raise AllocConfError(f"{key} must be at least {least} (MiB), not {value}")
    return value


def _bool(key: str, raw: str) -> bool:
    if raw in ("True", "true", "1"):
        return True
    if raw in ("False", "false", "0"):
        return False
    raise AllocConfError(f"{key} must be True or False, not {raw!r}")


def _threshold(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise AllocConfError(f"{key} must be a number in (0, 1), not {raw!r}") from None
    if not 0.0 < value < 1.0:
        raise AllocConfError(f"{key} must be in (0, 1), not {raw!r}")
    return value


def parse_alloc_conf(text: str | None) -> AllocConf:
    """Parse ``"expandable_segments:True,max_split_size_mb:128"`` (empty or None: defaults)."""
    conf = AllocConf()
    if not text or not text.strip():
        return conf
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition(":")
        key, raw = key.strip(), raw.strip()
        if not sep or not raw:
            raise AllocConfError(f"alloc conf item {item!r} is not key:value")
        if key == "expandable_segments":
            conf = replace(conf, expandable_segments=_bool(key, raw))
        elif key == "max_split_size_mb":
            conf = replace(conf, max_split_size_mb=_mib(key, raw, 20))
        elif key == "max_non_split_rounding_mb":
            conf = replace(conf, max_non_split_rounding_mb=_mib(key, raw, 20))
        elif key == "garbage_collection_threshold":
            conf = replace(conf, garbage_collection_threshold=_threshold(key, raw))
        elif key == "roundup_power2_divisions":
            conf = replace(conf, roundup_power2_divisions=raw)
        elif key == "backend":
            if raw != "native":
                raise AllocConfError(f"backend {raw!r} is not modelled; only native is")
        else:
            known = ", ".join((*_MODELLED, *_IGNORED))
            raise AllocConfError(f"unknown alloc conf key {key!r}; known keys: {known}")
    return conf
