"""The cgroup source: every container's memory cgroup on the node is a memory domain.

Host-memory OOMs kill training jobs too (data loader workers, pinned buffers, a leaking
metrics thread), and the kernel enforces the limit of a container's memory cgroup, not of
the machine. This source finds those cgroups under a root directory (``/sys/fs/cgroup`` on a
v2 node, ``/sys/fs/cgroup/memory`` on a v1 node, or a fixture tree in tests) and samples each
one: limit, usage, anonymous memory, peak since the previous read, ``failcnt``/``max``
events, and on v2 the memory pressure (PSI; read at most once a second, as the kernel
renews it every 2 s). A rising OOM-kill counter becomes an ``oom`` event.

Which cgroups are domains: the processes live in leaf cgroups (a container), and the limit
that will stop them is the nearest one on the way up. So each cgroup that holds processes
is mapped to itself if it has a finite limit, else to its nearest limited ancestor below
the root; the set of those is the set of domains. A container without a limit of its own in
a pod with one is watched at the pod. Cgroups are found again every ``rescan_s`` seconds, and
a cgroup that disappears (the container ended) is dropped quietly.

OOM kills are counted so that one kill is one event, on the domain whose limit it belongs
to. The kernel counts a kill on the victim's cgroup; on v2 every ancestor's ``memory.events``
includes it, on v1 nothing propagates. So a v2 domain's kills are its counter less those of
the watched domains below it, and a v1 domain's are the sum over the cgroups whose processes
it watches. A v2 container cgroup removed right after its kill (the runtime does this within
milliseconds) leaves its kill in its parent's counter; a rise there that no surviving domain
explains is given to the domain that vanished. On v1 such a kill is lost with the cgroup.

The agent never writes to the cgroups it watches: a v1 peak reset would also reset what
cAdvisor and others read, so v1 samples carry no ``peak_bytes`` (v2 resets are private to the
reader's descriptor and are used).

Each watched cgroup keeps its files open between reads (see ``collectors/cgroupfs.py``), as
does each parent whose counter witnesses vanished domains; they are closed when the domain
leaves and on :meth:`CgroupSource.close`.
"""

from __future__ import annotations

import fnmatch
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from oomcast.collectors.cgroupfs import (
    CgroupError,
    CgroupUnavailable,
    MemoryCgroup,
    Pressure,
    detect_version,
)
from oomcast.collectors.jobnames import job_name, parse_cgroup_path
from oomcast.model.schema import Event, Record

log = logging.getLogger(__name__)

# The kernel recomputes a cgroup's PSI averages every 2 s, and only /metrics shows them: a
# source sampling faster than this reads memory.pressure once per this many seconds.
PSI_EVERY_S = 1.0


@dataclass
class CgroupStats:
    scans: int = 0
    reads: int = 0
    read_errors: int = 0
    oom_kills: int = 0
    vanished: int = 0
    vanished_oom_kills: int = 0  # kills given to a domain whose cgroup was already gone


@dataclass
class _Domain:
    cgroup: MemoryCgroup
    rel: str
    device: str
    job: str | None
    kills: int | None  # v2: the domain's hierarchical counter; v1: summed over ``members``
    members: list[MemoryCgroup] = field(default_factory=list)  # v1: cgroups of its processes
    witness: Path | None = None  # v2: the parent, whose counter outlives the domain
    witness_kills: int | None = None
    last_ts: float = 0.0
    pressure: Pressure | None = None
    psi_in: int = 0  # polls until memory.pressure is read again (0: at this one)


@dataclass
class CgroupSource:
    """Sample the memory cgroups under ``root``.

    ``include``/``exclude`` are globs on the cgroup's path relative to the root, with a
    leading ``/`` (``/kubepods*``, ``/system.slice/*``); ``job_of`` names the job that owns a
    cgroup from that path (the default: the same names the NVML source gives GPU processes,
    ``pod:<uid>``, ``container:<id>``, else the last path component).
    """

    node: str
    root: Path | str
    interval_s: float = 1.0
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    rescan_s: float = 10.0
    max_depth: int = 10
    job_of: Callable[[str], str | None] | None = None
    name: str = "cgroup"
    stats: CgroupStats = field(default_factory=CgroupStats)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s={self.interval_s} must be positive")
        self.root = Path(self.root)
        # fails here, at start-up, with a clear reason when the root is not a memory cgroup
        self.version = detect_version(self.root)
        self._domains: dict[str, _Domain] = {}
        self._witnesses: dict[Path, MemoryCgroup] = {}  # parents read for vanished kills
        self._paths: dict[Path, Path] = {}  # the witnesses' Path objects, see _one_path
        self._next_sample = 0.0
        self._next_scan = 0.0
        self._no_counter_warned = False
        self._psi_every = max(1, round(PSI_EVERY_S / self.interval_s))  # in polls

    # -- discovery ------------------------------------------------------------------------
    def _rel(self, path: Path) -> str:
        rel = path.relative_to(self.root).as_posix()
        return "/" if rel == "." else "/" + rel

    def _wanted(self, rel: str) -> bool:
        return any(fnmatch.fnmatchcase(rel, g) for g in self.include) and not any(
            fnmatch.fnmatchcase(rel, g) for g in self.exclude
        )

    def _walk(self) -> Iterator[Path]:
        stack = [(Path(self.root), 0)]
        while stack:
            path, depth = stack.pop()
            yield path
            if depth >= self.max_depth:
                continue
            try:
                with os.scandir(path) as it:
                    children = [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
            except OSError:
                continue
            stack.extend((c, depth + 1) for c in sorted(children, reverse=True))

    @staticmethod
    def _has_procs(path: Path) -> bool:
        try:
            with open(path / "cgroup.procs", "rb") as fh:
                return bool(fh.read(1).strip())
        except OSError:
            return False

    def _cgroup(self, path: Path) -> MemoryCgroup:
        return MemoryCgroup(path, self.version, shared_reset=False)

    def _limited_path(self, path: Path) -> bool:
        probe = self._cgroup(path)
        try:
            return self._limited(probe)
        finally:
            probe.close()

    def _limited(self, cg: MemoryCgroup) -> bool:
        try:
            limit = cg.limit()
        except (OSError, CgroupError):
            return False
        return limit is not None and limit > 0

    def _counter(self, cg: MemoryCgroup) -> int | None:
        try:
            return cg.oom_kills()
        except (OSError, CgroupError):
            return None

    def _witness_counter(self, path: Path | None) -> int | None:
        if path is None:
            return None
        cg = self._witnesses.get(path)
        if cg is None:
            cg = self._witnesses[path] = self._cgroup(path)
        try:
            return cg.oom_kills()
        except (OSError, CgroupError):
            return None

    def _drop(self, dom: _Domain) -> None:
        """Close what a domain that left holds open."""
        dom.cgroup.close()
        for m in dom.members:
            m.close()

    def scan(self) -> list[str]:
        """Find the domains now under the root; returns their device names."""
        self.stats.scans += 1
        root = Path(self.root)
        limited: dict[Path, bool] = {}
        found: dict[str, tuple[Path, list[Path]]] = {}  # rel -> (domain path, process cgroups)
        for path in self._walk():
            limited[path] = path != root and self._limited_path(path)
            if not self._has_procs(path):
                continue
            owner = path
            while owner != root and not limited.get(owner, False):
                owner = owner.parent
            if owner == root:
                continue  # nothing below the root limits these processes
            rel = self._rel(owner)
            if self._wanted(rel):
                found.setdefault(rel, (owner, []))[1].append(path)
        for rel in list(self._domains):
            if rel not in found:
                self._drop(self._domains.pop(rel))
        for rel, (path, procs) in found.items():
            dom = self._domains.get(rel)
            if self.version == 1:
                members = self._v1_members(dom, [path, *procs])
                if dom is not None:  # new process cgroups join at their current count
                    dom.members = members
                    dom.kills = self._v1_kills(members)
                    continue
            elif dom is not None:
                continue
            cg = self._cgroup(path)
            if self.version == 1:
                kills = self._v1_kills(members)
                witness = None
            else:
                members = []
                kills = self._counter(cg)
                witness = self._one_path(path.parent) if path.parent != root else None
            if kills is None and not self._no_counter_warned:
                self._no_counter_warned = True
                log.warning(
                    "cgroup %s has no OOM-kill counter (kernel before 4.13?): its usage is"
                    " sampled, but its OOM kills will not become events",
                    rel,
                )
            self._domains[rel] = _Domain(
                cg,
                rel,
                f"cgroup:{rel}",
                (self.job_of or default_job_of)(rel),
                kills,
                members,
                witness,
                self._witness_counter(witness),
            )
        needed = {d.witness for d in self._domains.values()}
        for p in [p for p in self._witnesses if p not in needed]:
            self._witnesses.pop(p).close()
        self._paths = {p: p for p in needed if p is not None}
        return sorted(d.device for d in self._domains.values())

    def _one_path(self, path: Path) -> Path:
        """The one Path object this source uses for ``path``: every tick looks parents up
        by it, and a dict finds the same object without pathlib's ``==`` (Python code)."""
        return self._paths.setdefault(path, path)

    def _v1_members(self, dom: _Domain | None, paths: list[Path]) -> list[MemoryCgroup]:
        """The cgroups whose processes a v1 domain watches, keeping the ones (and their open
        files) it already had."""
        kept = {m.path: m for m in dom.members} if dom is not None else {}
        members = [kept.pop(p) if p in kept else self._cgroup(p) for p in dict.fromkeys(paths)]
        for m in kept.values():
            m.close()
        return members

    def _v1_kills(self, members: list[MemoryCgroup]) -> int | None:
        total, any_counter = 0, False
        for m in members:
            n = self._counter(m)
            if n is not None:
                total += n
                any_counter = True
        return total if any_counter else None

    # -- sampling ---------------------------------------------------------------------------
    def poll(self, now: float) -> list[Record]:
        if now < self._next_sample:
            return []
        due = self._next_sample + self.interval_s
        self._next_sample = due if due > now else now + self.interval_s  # no catch-up burst
        rescan = now >= self._next_scan
        if rescan and not self._domains:  # nothing watched yet: find the domains first
            self.scan()
            self._next_scan, rescan = now + self.rescan_s, False
        out: list[Record] = []
        raw: dict[str, int] = {}  # counter rises this tick, per surviving domain
        alive: list[tuple[_Domain, float]] = []
        gone: list[_Domain] = []
        self._read(list(self._domains.items()), now, out, raw, alive, gone)
        events = self._oom_events(raw, alive, gone, now)
        if rescan:
            # after this tick's reads: a rescan drops a cgroup its OOM kill just emptied
            # (no processes left) and re-bases the counters of the ones it keeps, so a
            # scan before the reads lost the kill of the tick it came on; the domains it
            # finds are sampled on this tick still
            before = set(self._domains)
            self.scan()
            self._next_scan = now + self.rescan_s
            new = [(rel, d) for rel, d in self._domains.items() if rel not in before]
            self._read(new, now, out, {}, [], [])
        return out + events

    def _read(
        self,
        domains: list[tuple[str, _Domain]],
        now: float,
        out: list[Record],
        raw: dict[str, int],
        alive: list[tuple[_Domain, float]],
        gone: list[_Domain],
    ) -> None:
        """Sample ``domains`` into ``out``, noting the rise of each one's OOM-kill counter in
        ``raw``, the domains read in ``alive`` and the vanished ones in ``gone``."""
        for rel, dom in domains:
            with_psi = dom.psi_in <= 0
            try:
                reading = dom.cgroup.read(with_pressure=with_psi)
                if with_psi:
                    dom.pressure, dom.psi_in = reading.pressure, self._psi_every
            except FileNotFoundError:
                self.stats.vanished += 1
                gone.append(self._domains.pop(rel))
                self._drop(dom)
                continue
            except (OSError, CgroupError) as exc:
                self.stats.read_errors += 1
                log.debug("cgroup %s: %s", rel, exc)
                continue
            self.stats.reads += 1
            dom.psi_in -= 1
            ts = max(now, dom.last_ts + 1e-6)  # a domain's samples are strictly ordered
            dom.last_ts = ts
            alive.append((dom, ts))
            limit = reading.limit_bytes
            if limit is not None and limit > 0:  # a zero limit is a cgroup being torn down
                out.append(reading.sample(ts, self.node, dom.device, dom.job))
            kills = self._v1_kills(dom.members) if self.version == 1 else reading.oom_kills
            if kills is not None and dom.kills is not None and kills > dom.kills:
                raw[rel] = kills - dom.kills
            if kills is not None:
                dom.kills = kills

    def _oom_events(
        self,
        raw: dict[str, int],
        alive: list[tuple[_Domain, float]],
        gone: list[_Domain],
        now: float,
    ) -> list[Record]:
        events: list[Record] = []
        for dom, ts in alive:
            rise = raw.get(dom.rel, 0)
            if rise and self.version == 2:  # v2 counters include the watched domains below
                inner = sum(n for r, n in raw.items() if r.startswith(dom.rel.rstrip("/") + "/"))
                rise -= inner
            if rise > 0:
                self.stats.oom_kills += rise
                events.append(
                    Event(ts=ts, node=self.node, device=dom.device, event="oom", job=dom.job)
                )
        # v2: a kill whose cgroup was removed before this read shows in the parent's counter
        witnesses: dict[Path, int | None] = {}
        for dom in gone:
            if dom.witness is None or dom.witness_kills is None:
                continue
            if dom.witness not in witnesses:
                now_kills = self._witness_counter(dom.witness)
                explained = sum(
                    n
                    for r, n in raw.items()
                    if (Path(self.root) / r.lstrip("/")).is_relative_to(dom.witness)
                )
                witnesses[dom.witness] = (
                    None if now_kills is None else now_kills - dom.witness_kills - explained
                )
            left = witnesses[dom.witness]
            if left is not None and left > 0:
                witnesses[dom.witness] = left - 1
                self.stats.oom_kills += 1
                self.stats.vanished_oom_kills += 1
                ts = max(now, dom.last_ts + 1e-6)
                events.append(
                    Event(ts=ts, node=self.node, device=dom.device, event="oom", job=dom.job)
                )
        # the parents' counters as of this read, for the next one
        read: dict[Path, int | None] = {}
        for dom, _ts in alive:
            if dom.witness is not None:
                if dom.witness not in read:
                    read[dom.witness] = self._witness_counter(dom.witness)
                dom.witness_kills = read[dom.witness]
        return events

    def pressure(self) -> dict[str, Pressure]:
        """The latest memory PSI per device (v2 only)."""
        domains = list(self._domains.values())  # /metrics reads this from another thread
        return {d.device: d.pressure for d in domains if d.pressure is not None}

    def metric_samples(self) -> list[tuple[str, str, str, dict[str, str], float]]:
        """Figures for the agent's /metrics: read errors, OOM kills seen, PSI per domain."""
        st = self.stats
        out: list[tuple[str, str, str, dict[str, str], float]] = [
            (
                "oomcast_agent_cgroup_domains",
                "gauge",
                "Memory cgroups watched.",
                {},
                len(self._domains),
            ),
            (
                "oomcast_agent_cgroup_read_errors_total",
                "counter",
                "Failed cgroup reads.",
                {},
                st.read_errors,
            ),
            (
                "oomcast_agent_cgroup_oom_kills_total",
                "counter",
                "OOM kills seen in watched cgroups.",
                {},
                st.oom_kills,
            ),
        ]
        for device, p in self.pressure().items():
            for kind, value in (("some", p.some_avg10), ("full", p.full_avg10)):
                out.append(
                    (
                        "oomcast_agent_memory_pressure_avg10",
                        "gauge",
                        "Percent of the last 10 s that the cgroup's tasks stalled on memory (PSI).",
                        {"device": device, "kind": kind},
                        value,
                    )
                )
        return out

    @property
    def devices(self) -> list[str]:
        return sorted(d.device for d in list(self._domains.values()))

    @property
    def exhausted(self) -> bool:
        return False

    def close(self) -> None:
        """Close every file held open; a later poll finds the cgroups and opens them again."""
        for dom in self._domains.values():
            self._drop(dom)
        self._domains.clear()
        for cg in self._witnesses.values():
            cg.close()
        self._witnesses.clear()
        self._next_scan = 0.0


def default_job_of(rel: str) -> str | None:
    """The job a cgroup belongs to, read off its path the way the NVML source names the
    owner of a GPU process (``pod:<uid>``, ``slurm:<id>``, ``container:<id12>``), so both
    sources agree; else the cgroup's own name."""
    ident = parse_cgroup_path(rel)
    if ident.known:
        return job_name(ident, 0)
    return rel.rstrip("/").rsplit("/", 1)[-1] or None


__all__ = ["CgroupSource", "CgroupStats", "CgroupUnavailable", "default_job_of"]
