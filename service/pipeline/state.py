"""Live per-domain state: the latest sample, the forecaster's state, recent history, and
each rule's episode.

``LiveState.apply`` takes a batch of samples (from any number of domains), refuses those
out of time order, steps the forecaster once for the batch, and runs every rule's episode
on each forecast (``service/pipeline/rules.py`` decides; this module only keeps the state). It is
synchronous, does no I/O and reads no clock (``now`` is an argument): the ingest loop calls
it and handles Redis and deliveries itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from oomcast.model.events import ScheduleEvent
from oomcast.model.forecast import Embedding as ForecastEmbedding
from oomcast.model.forecast import (
    Forecast,
    Forecaster,
    embedding_version,
    release_state,
    step_arrays,
)
from oomcast.model.phase import PhaseForecast, PhaseState
from oomcast.model.schema import Domain, Event, Sample, SchemaError
from oomcast.service.api.device_query import DeviceFilter, DevicePage, RankCache, query_devices
from oomcast.service.pipeline.explainer import diagnosis_of, explained
from oomcast.service.pipeline.history import History
from oomcast.service.pipeline.outcomes import (
    CHAMPION,
    Outcome,
    Scored,
    Watch,
    hand_over,
    observe,
    on_end,
    on_oom,
)
from oomcast.service.pipeline.phases import forget_job, on_schedule, phase_step
from oomcast.service.pipeline.rules import (
    Alert,
    Episode,
    Rule,
    advance,
    end_episode,
    fires_any,
    still_firing,
)

log = logging.getLogger(__name__)


@dataclass
class DomainState:
    domain: Domain
    forecaster_state: Any
    history: History
    last: Sample | None = None
    forecast: Forecast | None = None
    samples_seen: int = 0
    ooms_seen: int = 0
    last_oom_ts: float | None = None
    last_seen_wall: float = 0.0
    job: str | None = None
    episodes: dict[str, Episode] = field(default_factory=dict)  # per rule name
    # Evidence for node actions: when a sample signed by the domain's own node, and when one
    # that was not (over HTTP, unsigned, another node's), was last applied (wall time).
    attested_at: float | None = None
    unattested_at: float | None = None
    # Samples refused in a row for being behind the newest one (and the last such ts): a
    # run of them, in order among themselves, means the newest was bogus or the clock moved.
    behind: int = 0
    behind_ts: float = 0.0
    # Which of the rules match the domain, and the (kind, job) that was computed for.
    rule_key: tuple[str, str | None] | None = None
    rule_matches: tuple[bool, ...] = ()
    # The job's schedule, once it announced one (service/pipeline/phases.py), and what the phase
    # forecast made of the newest sample: its cause ("phase:eval") when it drives it.
    phases: PhaseState | None = None
    cause: str | None = None
    phase_forecast: PhaseForecast | None = None
    first: Sample | None = None  # the job's first sample: baselines for pipeline/explainer.py
    # What each firing episode was told (cause, remedies, evidence, thin): its resolved
    # alert says the same, rather than what the memory looks like after the OOM
    told: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    # True only once every episode was seen neither firing nor over its bar: until a rule
    # fires on a forecast, nothing of the domain's rules can change, and they are skipped
    # (``LiveState._apply_round``). Episodes only leave that state through ``advance``.
    quiet: bool = False
    # When this replica restored the domain from a snapshot (wall time), and when the first
    # sample signed by the domain's node came after that: a restored state is a warm start,
    # not evidence; node actions wait RESTORED_PROBATION_S from that first signed sample.
    # Never carried in a snapshot (service/cluster/snapshot.py LOCAL_ONLY).
    restored_at: float | None = None
    own_since: float | None = None
    # Per scored model (champion, shadow): its own alert rule's episode and what the job
    # and the alert came to so far (service/pipeline/outcomes.py).
    watches: dict[str, Watch] = field(default_factory=dict)
    # Per shadow model (a scored role with a forecaster of its own): its forecaster's state
    # for this domain, stepped on the same samples as the champion's.
    shadow_states: dict[str, Any] = field(default_factory=dict)

    def summary(self, horizon_s: int) -> dict[str, Any]:
        s, f = self.last, self.forecast
        assert s is not None and f is not None
        alert = self._alert_summary()
        why = diagnosis_of(self)
        cause: str | None = why.cause if why else "unknown"
        remedies = list(why.remedies) if why else []
        evidence = why.evidence if why else None
        thin = list(why.thin) if why else []
        in_sight = (
            alert["firing"]
            or any(ep.above for ep in self.episodes.values())  # over a rule's bar, not yet firing
            or f.time_to_oom_s is not None
            or self.phase_forecast is not None
        )
        if not in_sight:
            # A cause answers "why is the OOM coming": with none in sight, naming one (a
            # "leak" at 0.2% risk) reads as a diagnosis nobody should act on.
            shape = (
                f"; the recent use reads as: {evidence}" if why and why.cause != "unknown" else ""
            )
            cause, remedies, thin = None, [], []
            evidence = (
                f"no OOM in sight: risk {f.risk_at(horizon_s):.1%} within {horizon_s} s{shape}"
            )
        return {
            "node": s.node,
            "device": s.device,
            "kind": s.kind,
            "job": self.job,
            "used_bytes": s.used_bytes,
            "total_bytes": s.total_bytes,
            "used_frac": round(s.used_frac, 4),
            "observed_at": s.ts,
            "risk": {str(h): round(p, 4) for h, p in f.risk.items()},
            "alert_risk": round(f.risk_at(horizon_s), 4),
            "time_to_oom_s": None if f.time_to_oom_s is None else round(f.time_to_oom_s, 1),
            "model_version": f.model_version,
            "allocated_bytes": s.allocated_bytes,
            "reserved_bytes": s.reserved_bytes,
            "cause": cause,
            "remedies": remedies,
            "evidence": evidence,
            "cause_thin": thin,
            "phase": None if self.phase_forecast is None else self.phase_forecast.to_dict(),
            "alert": alert,
            "samples_seen": self.samples_seen,
            "ooms_seen": self.ooms_seen,
            "last_oom_ts": self.last_oom_ts,
            "processes": None
            if s.processes is None
            else [p.to_dict() for p in sorted(s.processes, key=lambda p: -(p.used_bytes or 0))],
        }

    def _alert_summary(self) -> dict[str, Any]:
        firing = {n: t for n, t in self.episodes.items() if t.firing}
        first = min(firing.values(), key=lambda t: t.fired_at or 0.0) if firing else None
        return {
            "firing": bool(firing),
            "episode": first.episode if first else None,
            "fired_at": first.fired_at if first else None,
            "rules": {
                n: {"firing": t.firing, "episode": t.episode, "suppressed": t.suppressed}
                for n, t in self.episodes.items()
            },
        }


def _cause(st: DomainState) -> str | None:
    why = diagnosis_of(st)
    return why.cause if why is not None else None


def _seen_before(st: DomainState, sample: Sample) -> bool:
    """A redelivered sample matches one already in the domain's history."""
    return st.history.seen(sample.ts, sample.used_bytes)


def _took(st: DomainState, sample: Sample, attested: bool, now: float) -> None:
    """The domain took ``sample`` as its newest (and who vouched for it, when)."""
    st.last = sample
    st.behind = 0
    if attested:
        st.attested_at = now
        if st.restored_at is not None and st.own_since is None:
            st.own_since = now
    else:
        st.unattested_at = now


class Rejected(NamedTuple):
    """A sample refused by the live state; ``code`` is one of ingest's REJECT_CODES."""

    sample: Sample
    problem: SchemaError
    code: str


@dataclass(slots=True)
class Applied:
    """What one batch did: the forecasts made, the samples refused, and the alerts."""

    forecasts: list[tuple[DomainState, Forecast]] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    duplicates: int = 0
    alerts: list[Alert] = field(default_factory=list)
    late: int = 0
    clock_resets: int = 0


Embedding = ForecastEmbedding | None


def tune_gc() -> None:
    """For a process that holds many domains' state (the service, its benchmarks). Ingest
    makes and drops a few small objects per sample (a sample, a forecast): at Python's
    default thresholds the young generation is collected every 700 allocations and the
    older ones walk every long-lived object. Move what exists at start-up out of the
    collector's sight and collect the young generation less often: the same garbage, in
    fewer walks (the drain went from 25k to 34-39k samples/s with it)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


# How long a domain restored from a snapshot takes this replica's own samples before its
# forecasts count as evidence for node actions (alerts and webhooks do not wait).
RESTORED_PROBATION_S = 60.0
TRIM_AFTER = 1000  # domains dropped at once before the process hands freed memory back


def return_memory() -> None:
    """Collect, then ask glibc to give freed heap pages back to the system: Python keeps
    freed memory for reuse, so a flood of domains that expired left the service's RSS at
    1 GB. Where there is no glibc, nothing more than the collection happens."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


RESYNC_SLACK_S = 5.0  # how far ahead of the service's clock a newest sample may honestly be


class LiveState:
    """Every domain's state; ``rules`` (highest priority first) each keep their own episode
    per domain, and ``horizon_s`` is the horizon domains are shown and ranked by."""

    def __init__(
        self,
        forecaster: Forecaster,
        rules: Sequence[Rule],
        *,
        horizon_s: int,
        history_len: int = 600,
        resync_after: int = 3,
        attest_window_s: float = 600.0,
        max_domains: int | None = None,
        max_domains_per_node: int | None = None,
        scored: Sequence[Scored] = (),
    ) -> None:
        self.forecaster = forecaster
        self.rules = list(rules)
        self.horizon_s = horizon_s
        self.history_len = history_len
        self.resync_after = resync_after
        self.attest_window_s = attest_window_s
        # Caps on the domains held: each costs ~28 KB (docs/scaling.md), and anyone who can
        # write a stream could otherwise make a million. A new domain past either is refused
        # (dead-lettered as domain_cap); the domains already held go on.
        self.max_domains = max_domains
        self.max_domains_per_node = max_domains_per_node
        self.domains: dict[Domain, DomainState] = {}
        self.per_node: dict[str, int] = {}
        self.events_over_cap = 0  # events of new domains past the caps, dropped
        # The models scored on every domain's outcomes, and the outcomes decided since the
        # ingest loop last took them (``take_outcomes``).
        self.scored = list(scored)
        self.shadows = [s for s in self.scored if s.forecaster is not None]
        self.shadow_failures = 0  # rounds a shadow model failed on (it raised)
        self.outcomes: list[Outcome] = []

    def take_outcomes(self) -> list[Outcome]:
        out, self.outcomes = self.outcomes, []
        return out

    def _version(self, st: DomainState, s: Scored) -> str:
        w = st.watches.get(s.role)
        if w is not None and w.version:  # the model whose watch it is (a swap moves them)
            return w.version
        if s.forecaster is not None:  # a shadow's outcomes are of its own model
            return str(s.forecaster.version)
        return st.forecast.model_version if st.forecast is not None else self.forecaster.version

    def _end_watches(self, st: DomainState) -> None:
        """The domain's job ended without an OOM: each scored model's outcome of it."""
        for s in self.scored:
            w = st.watches.get(s.role)
            if w is not None:
                self.outcomes.extend(on_end(w, s, st.last, st.job, self._version(st, s)))

    def _hand_over(self, st: DomainState) -> None:
        """Another job took the domain: each scored model's watch starts afresh, holding the
        ended job's until its OOM event can no longer come."""
        for s in self.scored:
            w = st.watches.get(s.role)
            if w is not None:
                st.watches[s.role], found = hand_over(w, s, st.last, st.job, self._version(st, s))
                self.outcomes.extend(found)

    def _observe(
        self, st: DomainState, sample: Sample, fc: Forecast, shadow: dict[str, Forecast]
    ) -> None:
        for s in self.scored:
            own = fc if s.forecaster is None else shadow.get(s.role)
            if own is None:  # the shadow failed this round: it sees nothing of it
                continue
            w = st.watches.get(s.role)
            if w is None:
                w = st.watches[s.role] = Watch()
            if w.version is None:
                w.version = own.model_version
            found = observe(w, s, sample, own, st.job, _cause, st)
            if found:
                self.outcomes.extend(found)

    def _step_shadows(
        self, states: list[DomainState], samples: list[Sample], embs: list[Embedding]
    ) -> list[dict[str, Forecast]]:
        """Each shadow model stepped once for the round, on the same samples; per domain,
        each shadow's forecast by role. The nodes' embeddings go along only where they are
        of the shadow's own version."""
        out: list[dict[str, Forecast]] = [{} for _ in states]
        champion_v = embedding_version(self.forecaster)
        for s in self.shadows:
            fc_model = s.forecaster
            try:
                slots = []
                for st in states:
                    slot = st.shadow_states.get(s.role)
                    if slot is None:
                        slot = st.shadow_states[s.role] = fc_model.init_state()
                    slots.append(slot)
                same = embedding_version(fc_model) == champion_v
                forecasts, _, _ = step_arrays(fc_model, slots, samples, embs if same else None)
            except Exception:  # the shadow must never stop the champion: it goes cold here
                self.shadow_failures += 1
                if self.shadow_failures in (1, 10, 100) or self.shadow_failures % 1000 == 0:
                    log.exception(
                        "shadow model %s failed on a round (%d failures so far); its states"
                        " of the round's domains start afresh",
                        fc_model.version,
                        self.shadow_failures,
                    )
                for st in states:
                    self._release_shadow(st, s)
                continue
            for found, fc in zip(out, forecasts, strict=True):
                found[s.role] = fc
        return out

    def swap_champion(
        self,
        forecaster: Forecaster,
        rules: Sequence[Rule],
        *,
        horizon_s: int,
        scored: Sequence[Scored],
        promoted: str | None = None,
    ) -> int:
        """Make ``forecaster`` the champion, acting by ``rules``, between two rounds (the
        ingest loop calls this between rounds; it is synchronous). With ``promoted`` (a
        shadow's role), ``forecaster`` is that shadow's model: each domain's state and
        outcome watch of the shadow become the champion's and the champion's become the
        shadow's (``scored`` names the old champion in that role), so both stay warm and a
        second promotion undoes the first. Otherwise every domain's champion state starts
        afresh, and the old model's watch ends there as if its job had (its standing alert
        censored unless the OOM comes before the new model's first sample). Returns how
        many domains were warm."""
        old = self.forecaster
        champion = next((s for s in self.scored if s.role == CHAMPION), None)
        warm = 0
        for st in self.domains.values():
            if promoted is not None:
                if promoted in st.shadow_states:  # a state may be None (a stateless baseline)
                    slot = st.shadow_states.pop(promoted)
                    warm += 1
                else:
                    slot = forecaster.init_state()
                st.shadow_states[promoted] = st.forecaster_state
                st.forecaster_state = slot
                mine, theirs = st.watches.pop(CHAMPION, None), st.watches.pop(promoted, None)
                if theirs is not None:
                    st.watches[CHAMPION] = theirs
                if mine is not None:
                    st.watches[promoted] = mine
            else:
                release_state(old, st.forecaster_state)
                st.forecaster_state = forecaster.init_state()
                # the old model's watch ends as if its job had (an OOM that comes before the
                # new model's first sample is still the old one's); the new one's starts
                w = st.watches.get(CHAMPION)
                if w is not None and champion is not None:
                    version = w.version or str(old.version)
                    st.watches[CHAMPION], found = hand_over(w, champion, st.last, st.job, version)
                    self.outcomes.extend(found)
            st.rule_key = None  # the rules are new objects: which match is worked out again
            st.quiet = False
        self.forecaster = forecaster
        self.rules = list(rules)
        self.horizon_s = horizon_s
        self.scored = list(scored)
        self.shadows = [s for s in self.scored if s.forecaster is not None]
        self.__dict__.pop("_rank_cache", None)  # its keys are risks at the old horizon
        return warm

    def _release_shadows(self, st: DomainState) -> None:
        for s in self.shadows:
            self._release_shadow(st, s)

    @staticmethod
    def _release_shadow(st: DomainState, s: Scored) -> None:
        slot = st.shadow_states.pop(s.role, None)
        if slot is not None:
            release_state(s.forecaster, slot)

    def _end_episodes(
        self, st: DomainState, reason: str, *, now: float, new_job: bool, job: str | None
    ) -> list[Alert]:
        """End every episode of the domain; a resolved alert, saying why, for each firing one."""
        last = (st.last, st.forecast) if st.last is not None and st.forecast is not None else None
        out = []
        for rule in self.rules:
            ep = st.episodes.get(rule.name)
            if ep is None:
                continue
            alert = end_episode(ep, rule, last, job=job, reason=reason, now=now, new_job=new_job)
            if alert is not None:
                out.append(explained(alert, st))
        return out

    def _state(self, domain: Domain) -> DomainState:
        st = self.domains.get(domain)
        if st is None:
            st = DomainState(domain, self.forecaster.init_state(), History(self.history_len))
            self._hold(st)
        return st

    def _hold(self, st: DomainState) -> None:
        if st.domain not in self.domains:
            self.per_node[st.domain[0]] = self.per_node.get(st.domain[0], 0) + 1
        self.domains[st.domain] = st

    def _drop(self, domain: Domain) -> DomainState | None:
        st = self.domains.pop(domain, None)
        if st is not None:
            left = self.per_node.get(domain[0], 1) - 1
            if left > 0:
                self.per_node[domain[0]] = left
            else:
                self.per_node.pop(domain[0], None)
            release_state(self.forecaster, st.forecaster_state)
            self._release_shadows(st)
            # /v1/devices' rank cache holds states too: a dropped domain must not live on
            # there (4,000 expired domains kept ~90 MB until the next unfiltered query)
            cache = self.__dict__.get("_rank_cache")
            if cache is not None:
                cache.entries.pop(domain, None)
        return st

    def over_cap(self, domain: Domain) -> str | None:
        """Why a new ``domain`` may not be held (None: it may, or it is held already)."""
        if domain in self.domains:
            return None
        if self.max_domains is not None and len(self.domains) >= self.max_domains:
            return f"{len(self.domains)} domains are held, the cap (OOMCAST_MAX_DOMAINS)"
        held = self.per_node.get(domain[0], 0)
        if self.max_domains_per_node is not None and held >= self.max_domains_per_node:
            return (
                f"node {domain[0]} has {held} domains, the cap per node"
                " (OOMCAST_MAX_DOMAINS_PER_NODE)"
            )
        return None

    def _restart_forecaster(self, st: DomainState) -> None:
        release_state(self.forecaster, st.forecaster_state)
        st.forecaster_state = self.forecaster.init_state()
        self._release_shadows(st)  # each starts afresh with its next sample

    def apply(
        self,
        samples: list[Sample],
        now: float,
        embeddings: Sequence[Embedding] | None = None,
        attested: Sequence[bool] | None = None,
    ) -> Applied:
        """Forecast a batch; samples of one domain are applied in order, one per round, so
        each round steps the forecaster once for all the domains in it (a batched call).
        ``embeddings`` runs parallel to ``samples`` (the node's, where they match), and so
        does ``attested`` (signed by the domain's own node; none are when not given)."""
        result = Applied()
        n = len(samples)
        embs: list[Embedding] = list(embeddings) if embeddings is not None else [None] * n
        signed = list(attested) if attested is not None else [False] * n
        if len(embs) != n or len(signed) != n:
            raise ValueError(f"{n} samples, {len(embs)} embeddings, {len(signed)} attested")
        domains = [(s.node, s.device) for s in samples]
        if len(set(domains)) == n:  # one sample per domain (the usual batch): one round
            self._apply_round(domains, samples, embs, signed, now, result)
            return result
        rounds: list[list[int]] = []
        depth: dict[Domain, int] = {}
        for i, d in enumerate(domains):
            k = depth.get(d, 0)
            depth[d] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(i)
        for r in rounds:
            self._apply_round(
                [domains[i] for i in r],
                [samples[i] for i in r],
                [embs[i] for i in r],
                [signed[i] for i in r],
                now,
                result,
            )
        return result

    def _admit(
        self, sample: Sample, attested: bool, now: float, result: Applied
    ) -> DomainState | None:
        """The domain's state, ready for this sample; None when the sample is refused."""
        full = self.over_cap(sample.domain)
        if full is not None:
            problem = SchemaError(
                "", f"{sample.node}/{sample.device}: a new domain, refused: {full}"
            )
            result.rejected.append(Rejected(sample, problem, "domain_cap"))
            return None
        st = self._state(sample.domain)
        if not attested and self._node_signs(st, now):
            problem = SchemaError(
                "",
                f"{sample.node}/{sample.device}: node {sample.node} signs its samples, and this"
                " one is not signed by it (forged, or sent over HTTP for a node's own domain)",
            )
            result.rejected.append(Rejected(sample, problem, "unattested"))
            return None
        if st.last_oom_ts is not None and sample.ts <= st.last_oom_ts:
            result.late += 1  # from the job that already OOMed, read after its OOM event
            return None
        if (
            st.last is not None
            and sample.ts <= st.last.ts
            and not self._resync(st, sample, now, result)
        ):
            return None
        if sample.job is not None and st.job is not None and sample.job != st.job:
            # Another job on the same device: its history is not this one's. The node
            # agent restarts its embedding here too; samples that come over HTTP have
            # their embedding computed in this state, so it must restart the same way.
            self._hand_over(st)
            self._restart_forecaster(st)
            reason = f"job {sample.job} replaced {st.job}"
            result.alerts.extend(self._end_episodes(st, reason, now=now, new_job=True, job=st.job))
            forget_job(st, sample.job)
        _took(st, sample, attested, now)
        return st

    def _resync(self, st: DomainState, sample: Sample, now: float, result: Applied) -> bool:
        """A sample not after the domain's newest: a redelivery (skipped), or out of order
        (refused). True when it is the ``resync_after``-th in a row of samples in order among
        themselves while the newest lies in the future (past ``now`` + a few seconds): then
        the newest was bogus (a forged or mis-stamped sample) or the node's clock moved back,
        and the domain starts a new history from this sample rather than stay blind until
        real time passes the bogus one. Old samples read again (a batch re-read after a
        takeover, older than the snapshot's history) never reset a domain: its newest is
        not in the future."""
        assert st.last is not None
        if _seen_before(st, sample):
            result.duplicates += 1  # at-least-once delivery sends some entries twice
            return False
        if st.last.ts <= now + RESYNC_SLACK_S:
            st.behind = 0
        else:
            st.behind = st.behind + 1 if st.behind and sample.ts > st.behind_ts else 1
        st.behind_ts = sample.ts
        if st.behind and st.behind >= self.resync_after:
            result.clock_resets += 1
            reason = (
                f"{st.behind} samples in a row came before the newest one ({st.last.ts});"
                " its timeline was wrong: a new history starts"
            )
            result.alerts.extend(self._end_episodes(st, reason, now=now, new_job=False, job=st.job))
            self._end_watches(st)
            self._restart_forecaster(st)
            st.history.clear()
            st.last = None
            return True
        problem = SchemaError(
            "ts",
            f"{sample.ts} is not after the previous sample of"
            f" {sample.node}/{sample.device} ({st.last.ts})",
        )
        result.rejected.append(Rejected(sample, problem, "out_of_order"))
        return False

    def firing(self, domains: Sequence[Domain], now: float) -> list[Alert]:
        """The episodes firing on ``domains`` (just restored from a snapshot, say), as alerts."""
        out = []
        for d in domains:
            st = self.domains.get(d)
            if st is None or st.last is None or st.forecast is None:
                continue
            for rule in self.rules:
                ep = st.episodes.get(rule.name)
                if ep is not None and ep.firing:
                    alert = still_firing(ep, rule, st.last, st.forecast, st.job, now)
                    out.append(explained(alert, st))
        return out

    def why_unattested(self, st: DomainState, attested: bool, now: float) -> str | None:
        """Why this domain's forecast is not attested evidence (None: it is): every sample
        of the domain for ``attest_window_s`` must be signed by its own node."""
        if not attested:
            return (
                "the forecast rests on a sample not signed by the domain's own node (sent"
                " over HTTP, or unsigned): no destructive action"
            )
        if st.restored_at is not None and (
            st.own_since is None or now - st.own_since < RESTORED_PROBATION_S
        ):
            return (
                f"the domain's state was restored from a snapshot {now - st.restored_at:.0f}s"
                " ago: a warm start, not evidence; node actions wait for"
                f" {RESTORED_PROBATION_S:g}s of this replica's own signed samples"
            )
        if st.unattested_at is not None and now - st.unattested_at <= self.attest_window_s:
            return (
                f"the domain had unsigned samples {now - st.unattested_at:.0f}s ago (within"
                f" {self.attest_window_s:g}s): no destructive action"
            )
        return None

    def _apply_round(
        self,
        domains: list[Domain],
        samples: list[Sample],
        embeddings: list[Embedding],
        signed: list[bool],
        now: float,
        result: Applied,
    ) -> None:
        """One round: at most one sample per domain (parallel sequences)."""
        states: list[DomainState] = []
        refused: list[int] = []
        known = self.domains
        window = self.attest_window_s
        for i, (d, sample, attested) in enumerate(zip(domains, samples, signed, strict=True)):
            st = known.get(d)
            last = None if st is None else st.last
            if (
                st is not None
                and last is not None
                and sample.ts > last.ts
                and (st.last_oom_ts is None or sample.ts > st.last_oom_ts)
                and (sample.job is None or st.job is None or sample.job == st.job)
                and (attested or st.attested_at is None or now - st.attested_at > window)
            ):
                # the usual sample: the domain's next one, of the same job, signed as its
                # others were; _admit's checks all pass and its updates are these
                _took(st, sample, attested, now)
            else:
                st = self._admit(sample, attested, now, result)
                if st is None:
                    refused.append(i)
                    continue
            states.append(st)
        admitted, embs = samples, embeddings
        if refused:  # the round less the refused samples
            gone = set(refused)
            keep = [i for i in range(len(samples)) if i not in gone]
            admitted = [samples[i] for i in keep]
            embs = [embeddings[i] for i in keep]
            signed = [signed[i] for i in keep]
        if not states:
            return
        forecasts, hot, risks, ttos = self._step(states, admitted, embs)
        shadow = self._step_shadows(states, admitted, embs) if self.shadows else None
        out = result.forecasts
        horizon = self.horizon_s
        scored = self.scored
        for i, (st, sample, fc, attested, fires) in enumerate(
            zip(states, admitted, forecasts, signed, hot, strict=True)
        ):
            if st.phases is not None:  # only a domain whose job announced a schedule
                merged = phase_step(st, sample, fc)
                if merged is not fc:  # the rules judge the merged forecast
                    fc, fires = merged, fires_any(self.rules, [merged])[0]
                    risks[i], ttos[i] = fc.risk_at(horizon), fc.time_to_oom_s
            st.forecast = fc
            st.samples_seen += 1
            st.last_seen_wall = now
            if sample.job is not None:
                st.job = sample.job
            if st.first is None:
                st.first = sample
            st.history.append(sample.ts, sample.used_bytes, sample.total_bytes, risks[i], ttos[i])
            if fires or not st.quiet:
                self._run_rules(st, sample, fc, attested, now, result)
            if scored:
                self._observe(st, sample, fc, shadow[i] if shadow is not None else {})
            out.append((st, fc))

    def _step(
        self, states: list[DomainState], samples: list[Sample], embs: list[Embedding]
    ) -> tuple[list[Forecast], list[bool], list[float], list[float | None]]:
        """One forecaster call for the round: the forecasts; per forecast whether any rule's
        bar is crossed by it (judged on the whole batch at once where the forecaster gives
        its arrays: a domain whose rules are all quiet needs nothing more from them); and
        per forecast the risk at ``horizon_s`` and the time to OOM, for the history."""
        slots = [st.forecaster_state for st in states]
        horizons = self.forecaster.horizons_s
        forecasts, risk, ttos = step_arrays(self.forecaster, slots, samples, embs)
        hot = fires_any(self.rules, forecasts, risk, horizons, ttos)
        if self.horizon_s in horizons:
            at_horizon: list[float] = risk[:, horizons.index(self.horizon_s)].tolist()
        else:
            at_horizon = [fc.risk_at(self.horizon_s) for fc in forecasts]
        return forecasts, hot, at_horizon, list(ttos)

    def _run_rules(
        self,
        st: DomainState,
        sample: Sample,
        fc: Forecast,
        attested: bool,
        now: float,
        result: Applied,
    ) -> None:
        """Every rule matching the domain, on its forecast; notes whether all are quiet."""
        episodes = st.episodes
        quiet = True
        for rule, matched in zip(self.rules, self._matches(st, sample), strict=True):
            ep = episodes.get(rule.name)
            if ep is None:
                ep = episodes[rule.name] = Episode()
            if matched and (ep.firing or ep.above or rule.fires(fc)):
                alert = advance(ep, rule, sample, fc, st.job, now)
                if alert is not None:
                    refused = self.why_unattested(st, attested, now)
                    if refused is not None:
                        alert = replace(alert, unattested=refused)
                    result.alerts.append(explained(alert, st))
            if ep.firing or ep.above:
                quiet = False
        st.quiet = quiet

    def _matches(self, st: DomainState, sample: Sample) -> tuple[bool, ...]:
        """Which rules apply to the domain, for its kind and job: matched once per change of
        either, not by pattern on every sample."""
        key = (sample.kind, st.job)
        if st.rule_key != key:
            st.rule_key = key
            st.rule_matches = tuple(r.match.matches(sample, st.job) for r in self.rules)
        return st.rule_matches

    def _node_signs(self, st: DomainState, now: float) -> bool:
        """Whether the domain's own node has signed a sample of it within the attestation
        window: then nothing unsigned may speak for the domain."""
        return st.attested_at is not None and now - st.attested_at <= self.attest_window_s

    def why_refused_event(self, event: Event, attested: bool, now: float) -> str | None:
        """Why an event does not count (None: it does). An ``oom`` not signed by the node it
        names counts only for a domain that node does not sign the samples of (the in-job
        hook's own domains, or a deployment without node keys): for a signed domain it
        would be a stranger ending its episodes and restarting its forecaster at will."""
        if attested or event.event != "oom":
            return None
        st = self.domains.get(event.domain)
        if st is None or not self._node_signs(st, now):
            return None
        return (
            f"{event.node}/{event.device}: an oom event not signed by node {event.node},"
            " whose samples of this domain are signed (forged, or sent by another party)"
        )

    def on_event(self, event: Event, now: float) -> list[Alert]:
        """Record an event; an OOM ends the domain's episodes and restarts its forecaster; a
        schedule is kept for the domain's phase forecasts. An event of a new domain past
        the caps is dropped (counted by ingest as ``events_over_cap``)."""
        if self.over_cap(event.domain) is not None:
            self.events_over_cap += 1
            return []
        if isinstance(event, ScheduleEvent):
            st = self._state(event.domain)
            st.last_seen_wall = max(st.last_seen_wall, now)  # not expired before its samples
            on_schedule(st, event)
            return []
        if event.event != "oom":
            return []
        st = self._state(event.domain)
        st.last_seen_wall = now
        if st.last is not None and (st.last_oom_ts is None or event.ts > st.last_oom_ts):
            # each scored model's outcome of the OOM (none for a repeat event of one job)
            for s in self.scored:
                w = st.watches.setdefault(s.role, Watch())
                self.outcomes.extend(on_oom(w, s, st.last, event.ts, st.job, self._version(st, s)))
        st.ooms_seen += 1
        st.last_oom_ts = max(event.ts, st.last_oom_ts or event.ts)
        out = self._end_episodes(st, "the job ran out of memory", now=now, new_job=True, job=st.job)
        # The job that OOMed is gone; its successor starts from a clean slate.
        self._restart_forecaster(st)
        forget_job(st, None)
        return out

    def expire(self, now: float, live_after_s: float) -> list[Alert]:
        """Forget domains silent for ``live_after_s``; a firing episode ends with a resolved
        alert that says why, rather than just vanishing."""
        out = []
        dropped = 0
        for domain, st in list(self.domains.items()):
            if now - st.last_seen_wall <= live_after_s:
                continue
            reason = f"no samples for {now - st.last_seen_wall:.0f}s"
            out.extend(self._end_episodes(st, reason, now=now, new_job=False, job=st.job))
            self._end_watches(st)
            self._drop(domain)
            dropped += 1
        if dropped >= TRIM_AFTER:
            return_memory()
        return out

    def live(self, now: float, live_after_s: float) -> list[DomainState]:
        """Domains with a forecast and a sample within ``live_after_s``."""
        return [
            st
            for st in self.domains.values()
            if st.forecast is not None and now - st.last_seen_wall <= live_after_s
        ]

    def ranked(self, now: float, live_after_s: float) -> list[DomainState]:
        """Live domains, riskiest first (risk at ``horizon_s``, then any horizon, then use)."""

        def key(st: DomainState) -> tuple[float, float, float]:
            fc = st.forecast
            assert fc is not None
            return (
                -fc.risk_at(self.horizon_s),
                -fc.max_risk,
                -(st.last.used_frac if st.last else 0.0),
            )

        return sorted(self.live(now, live_after_s), key=key)

    def query(self, now: float, live_after_s: float, where: DeviceFilter, limit: int) -> DevicePage:
        """One page of the live domains that pass ``where``, in ``ranked``'s order (ties
        broken by name), without sorting them all: ``service/api/device_query.py``."""
        cache = self.__dict__.get("_rank_cache")
        if cache is None:
            cache = self.__dict__["_rank_cache"] = RankCache()
        return query_devices(
            self.domains.values(),
            horizon_s=self.horizon_s,
            now=now,
            live_after_s=live_after_s,
            where=where,
            limit=limit,
            cache=cache,
        )

    # -- hand-over between replicas (service/cluster/snapshot.py holds the format) ---------------
    def snapshot(self, domain: Domain, *, history_points: int | None = None) -> bytes:
        """The domain's whole state as a versioned blob, for the replica that may take it
        over; KeyError when the domain is unknown."""
        from oomcast.service.cluster import snapshot

        points = snapshot.HISTORY_POINTS if history_points is None else history_points
        return snapshot.encode(
            self.domains[domain],
            self.forecaster,
            history_points=points,
            shadows=self._shadow_models(),
        )

    def _shadow_models(self) -> dict[str, Forecaster]:
        return {s.role: s.forecaster for s in self.shadows}

    def restore(
        self, blob: bytes, now: float | None = None, *, max_future_s: float = 300.0
    ) -> DomainState | None:
        """Install the domain state ``blob`` holds (replacing this replica's own copy of it,
        which a replica that just acquired the partition must not trust); None, with a
        warning, when the blob cannot be restored: the domain then starts cold."""
        from oomcast.service.cluster import snapshot

        now = time.time() if now is None else now
        st = snapshot.decode(
            blob,
            self.forecaster,
            [r.name for r in self.rules],
            history_len=self.history_len,
            now=now,
            max_future_s=max_future_s,
            shadows=self._shadow_models(),
        )
        if st is None:
            return None
        st.restored_at = now
        self._drop(st.domain)
        self._hold(st)
        return st

    def forget(self, domains: Iterable[Domain]) -> int:
        """Drop domains without a word (no resolved alerts): their partition now belongs to
        another replica, which carries their episodes on. Returns how many were dropped."""
        n = sum(self._drop(domain) is not None for domain in list(domains))
        if n >= TRIM_AFTER:
            return_memory()
        return n
