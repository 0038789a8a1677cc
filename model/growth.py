"""Growth beyond noise: robust slopes of a domain's level over 15, 30, 60 and 120 s.

The level is bucketed by second of trace time: each second keeps its lowest and highest
level. Slopes are ordinary least squares through the buckets' *lowest* levels in the
trailing window, so a transient spike (an evaluation, a checkpoint) moves the line only as
much as it lasts, and a sawtooth within a second does not move it at all; the same curve
sampled at 1 Hz or 10 Hz gives the same buckets. Each slope comes with its standard error
from the fit's residuals: a noisy level needs a longer or steeper rise before the rise
counts as growth.

From the fits come the features the forecaster and its evidence gate read
(``GROWTH_FEATURES``):

- the slope and its standard error per window, in percent of capacity per second;
- the projected time to the limit, from the highest level of the last 30 s at the recent
  pace (the 30 s fit), with its bounds at the slope plus and minus two standard errors: the
  earliest takes the lower of the 15 s and 30 s fits' upper bounds, so a climb that is
  levelling off is judged by how fast it rises now;
- deceleration: how much slower the last 15 s rose than the longest window there is (+1
  levelling off, 0 a steady pace, -1 speeding up);
- how long growth beyond noise has been going on (``growth_age_s``): a window's slope
  counts as growth when it is three standard errors above zero (``GROWTH_Z``);
- the largest fall of the level within the last 120 s (``drawdown_120s``): a sawtooth's
  next tooth climbs as straight as a leak, and only the drop before it tells them apart.

The fits are recomputed once per second of trace time (when a sample opens a new second),
from at most 121 buckets, and include the bucket just opened; samples within a second reuse
them. A domain's tracker is a few kilobytes and survives a snapshot (``to_dict``).
"""

from __future__ import annotations

import bisect
import itertools
import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

WINDOWS_S: tuple[int, ...] = (15, 30, 60, 120)
HISTORY_S = max(WINDOWS_S)
MIN_SLOPE = 1e-5  # fraction of capacity per second (3.6% an hour): slower is no growth
SE_FLOOR = 2e-6  # the resolution of a slope fitted through integer byte counts and clocks
MIN_SPAN = 0.9  # a window counts once its buckets span 90% of it
# A slope is growth when it is this many standard errors above zero: four windows are tested
# every second, so two errors (2.3% by chance, one-sided) would call noise growth every
# few seconds; three (0.13%) rarely do.
GROWTH_Z = 3.0
GROWTH_FEATURES: tuple[str, ...] = (
    *(f"slope_{w}s_pct_per_s" for w in WINDOWS_S),
    *(f"slope_se_{w}s_pct_per_s" for w in WINDOWS_S),
    "time_to_limit",  # squashed like time_to_full: 0 now, 1 an hour or never
    "time_to_limit_lo",  # at slope + 2 SE: the earliest
    "time_to_limit_hi",  # at slope - 2 SE: the latest (1 when that slope is not positive)
    "deceleration",
    "log1p_growth_age_s",
    # where a climb that is slowing down would level off (``levelling``)
    "plateau_headroom",  # 1 - the level it would level off at; -1: not levelling below 2x
    "slowing_per_min",  # how fast the pace is falling: -(y''/y') in 1/min, 0 when not
    # the largest fall of the level within the last 120 s (``drawdown``): a climb that
    # follows a drop (a sawtooth's next tooth) is not a leak going on
    "drawdown_120s",
    # the pace of the last 10 s and its standard error: a climb that stopped a few seconds
    # ago (a start-up's weights landing in one step) still has steep 15 s and 30 s fits
    "slope_10s_pct_per_s",
    "slope_se_10s_pct_per_s",
)
N_GROWTH = len(GROWTH_FEATURES)
TIME_CAP_S = 3600.0
REBASE_S = 3600.0  # the running sums start afresh this often (their x stays small)


def squash_s(seconds: float) -> float:
    """Seconds on the log scale the embedding uses for times: [0, 1], 1 at an hour or more."""
    return math.log1p(min(TIME_CAP_S, max(0.0, seconds))) / math.log1p(TIME_CAP_S)


@dataclass(slots=True)
class Fit:
    slope: float = 0.0  # fraction per second
    se: float = math.inf
    span_s: float = 0.0
    steady: bool = False  # the rise has lasted (``persistent``)

    @property
    def valid(self) -> bool:
        return math.isfinite(self.se)

    @property
    def growing(self) -> bool:
        """A rise beyond noise: ``GROWTH_Z`` standard errors above zero, faster than the
        floor, and one that has lasted (``persistent``)."""
        return (
            self.valid
            and self.steady
            and self.slope > MIN_SLOPE
            and self.slope - GROWTH_Z * self.se > 0.0
        )


def persistent(m1: float, m2: float, m3: float, step: float) -> bool:
    """Whether a window's rise has lasted and still goes on, from the means of its thirds
    and half the rise the fitted line gives a third (``step``): it rose by at least that
    from the first third to the middle one, and again from the middle one to the last. A
    spike at the window's end rises in the last third only (it may yet fall back), and is
    not growth until it has lasted; a jump at the window's start (a job's start-up, its
    weights landing) followed by a level rises in the first third only, and is not growth
    either, however steep the line fitted through it; a caching allocator's staircase, or
    a growing sequence length's, rises in steps through the window and is."""
    return m2 - m1 >= step and m3 - m2 >= step


def fit_windows(t: list[float], y: list[float], newest: float) -> list[Fit]:
    """OLS fits of ``y`` against ``t`` (oldest first) over each window of ``WINDOWS_S``
    ending at ``newest``; a window whose points span less than ``MIN_SPAN`` of it is not
    valid (its standard error is infinite)."""
    fits = []
    for window in WINDOWS_S:
        first = len(t)
        while first > 0 and newest - t[first - 1] <= window:
            first -= 1
        fits.append(_fit(t[first:], y[first:], newest, window))
    return fits


def _fit(t: list[float], y: list[float], newest: float, window: int) -> Fit:
    n = len(t)
    span = newest - t[0] if n else 0.0
    if n < 3 or span < MIN_SPAN * window:
        return Fit(span_s=span)
    xs = [v - newest for v in t]
    mt, my = sum(xs) / n, sum(y) / n
    vtt = sum((x - mt) ** 2 for x in xs)
    if vtt <= 0.0:
        return Fit(span_s=span)
    vty = sum((x - mt) * (v - my) for x, v in zip(xs, y, strict=True))
    slope = vty / vtt
    sse = sum((v - my - slope * (x - mt)) ** 2 for x, v in zip(xs, y, strict=True))
    se = max(SE_FLOOR, math.sqrt(max(0.0, sse) / (n - 2.0) / vtt))
    # the mean of each third of the window: each must be above the last by half the pace
    edges = (-span, -span * 2.0 / 3.0, -span / 3.0, 1.0)
    means = []
    for a, b in itertools.pairwise(edges):
        part = [v for x, v in zip(xs, y, strict=True) if a <= x < b]
        means.append(sum(part) / len(part) if part else math.nan)
    step = 0.5 * slope * span / 3.0
    steady = persistent(means[0], means[1], means[2], step)
    return Fit(slope, se, span, steady)


@dataclass(slots=True)
class GrowthTracker:
    sec: int | None = None  # the second being filled (floor of its ts)
    lo_now: float = 0.0
    hi_now: float = 0.0
    t: array[float] = field(default_factory=lambda: array("d"))  # closed seconds
    lo: array[float] = field(default_factory=lambda: array("d"))
    hi: array[float] = field(default_factory=lambda: array("d"))
    growth_since: float | None = None
    features: list[float] = field(default_factory=lambda: idle_features())
    # running sums of the closed buckets (count, x, x^2, y, xy, y^2 with x = t - anchor):
    # entry i holds the sums of the buckets before i, so any run of buckets is a difference
    # (derived: a restored tracker rebuilds them, to the last bits of rounding, so they are
    # left out of equality and of the saved state)
    _anchor: float = field(default=0.0, init=False, compare=False, repr=False)
    _sums: list[array[float]] = field(default_factory=list, init=False, compare=False, repr=False)

    def update(self, ts: float, level: float) -> list[float]:
        """Take one sample's level; the growth features as of this sample."""
        sec = math.floor(ts)
        if self.sec is not None and sec == self.sec:
            self.lo_now = min(self.lo_now, level)
            self.hi_now = max(self.hi_now, level)
            return self.features
        if self.sec is not None:  # close the second that ended
            if not self._sums or self.sec - self._anchor > REBASE_S:
                self._rebuild(float(self.sec))
            self.t.append(float(self.sec))
            self.lo.append(self.lo_now)
            self.hi.append(self.hi_now)
            self._push(float(self.sec) - self._anchor, self.lo_now)
            cut = bisect.bisect_left(self.t, sec - HISTORY_S)
            if cut:
                del self.t[:cut], self.lo[:cut], self.hi[:cut]
                for col in self._sums:
                    del col[:cut]
        self.sec, self.lo_now, self.hi_now = sec, level, level
        self.features = self._compute(float(sec))
        return self.features

    def _rebuild(self, anchor: float) -> None:
        """Running sums anew, relative to ``anchor`` (x stays small, the sums exact)."""
        self._anchor = anchor
        self._sums = [array("d", [0.0]) for _ in range(6)]
        for t, y in zip(self.t, self.lo, strict=True):
            self._push(t - anchor, y)

    def _push(self, x: float, y: float) -> None:
        for col, v in zip(self._sums, (1.0, x, x * x, y, x * y, y * y), strict=True):
            col.append(col[-1] + v)

    def _fit(self, now: float, window: int) -> Fit:
        """``fit_windows``' fit of one window from the running sums, with the bucket now
        being filled as its newest point."""
        t = self.t
        end = len(t)
        first = bisect.bisect_left(t, now - window)
        n = end - first + 1.0
        span = now - t[first] if first < end else 0.0
        if n < 3 or span < MIN_SPAN * window:
            return Fit(span_s=span)
        x_now, y_now = now - self._anchor, self.lo_now
        _, sx, sxx, sy, sxy, syy = (col[end] - col[first] for col in self._sums)
        sx, sxx, sy = sx + x_now, sxx + x_now * x_now, sy + y_now
        sxy, syy = sxy + x_now * y_now, syy + y_now * y_now
        vtt = sxx - sx * sx / n
        if vtt <= 0.0:
            return Fit(span_s=span)
        vty = sxy - sx * sy / n
        vyy = max(0.0, syy - sy * sy / n)
        slope = vty / vtt
        se = max(SE_FLOOR, math.sqrt(max(0.0, vyy - slope * vty) / (n - 2.0) / vtt))
        b1 = bisect.bisect_left(t, now - span * 2.0 / 3.0, first)
        b2 = bisect.bisect_left(t, now - span / 3.0, b1)
        ys = self._sums[3]
        if b1 == first or b2 == b1:
            return Fit(slope, se, span, False)
        m1 = (ys[b1] - ys[first]) / (b1 - first)
        m2 = (ys[b2] - ys[b1]) / (b2 - b1)
        m3 = (ys[end] - ys[b2] + y_now) / (end - b2 + 1)
        step = 0.5 * slope * span / 3.0
        return Fit(slope, se, span, persistent(m1, m2, m3, step))

    def _compute(self, now: float) -> list[float]:
        if not self._sums:
            self._rebuild(now)
        fits = [self._fit(now, w) for w in WINDOWS_S]
        growing = [f for f in fits if f.growing]
        if growing:  # growth goes back at least as far as the widest fit that shows it
            widest = max(f.span_s for f in growing)
            if self.growth_since is None or now - self.growth_since < widest:
                self.growth_since = now - widest
        else:
            self.growth_since = None
        age = 0.0 if self.growth_since is None else now - self.growth_since
        # the highest level of the last 30 s is what would reach the limit first
        recent = self.hi[bisect.bisect_left(self.t, now - 30) :]
        top = max(self.hi_now, max(recent)) if recent else self.hi_now
        headroom = max(0.0, 1.0 - top)
        if growing:
            mid, low, high = self._projection(fits, headroom)
        else:
            mid = low = high = 1.0
        # the 15 s fit against the longest other one there is: a climb that is levelling
        # off shows it within half a minute
        short, longest = fits[0], next((f for f in fits[:0:-1] if f.valid), None)
        if growing and short.valid and longest is not None:
            a, b = short.slope, longest.slope
            decel = max(-1.0, min(1.0, (b - a) / (abs(a) + abs(b) + 1e-5)))
        else:
            decel = 0.0
        plateau, slowing = self._levelling(now, fits) if growing else (-1.0, 0.0)
        now10 = self._fit(now, 10)
        return [
            *(_pct(f.slope) if f.valid else 0.0 for f in fits),
            *(min(10.0, f.se * 100.0) if f.valid else 10.0 for f in fits),
            mid,
            low,
            high,
            decel,
            math.log1p(age),
            plateau,
            slowing,
            self._drawdown(),
            *((_pct(now10.slope), min(10.0, now10.se * 100.0)) if now10.valid else (0.0, 10.0)),
        ]

    def _drawdown(self) -> float:
        """The largest fall of a second's lowest level below the lowest level of an earlier
        second, over the last 120 s and the second being filled (fraction of capacity, 0
        when the floor never fell). Floors, not highs: the swing within one training step
        (activations freed after the backward pass) is not a fall."""
        top, fall = -math.inf, 0.0
        for y in itertools.chain(self.lo, (self.lo_now,)):
            if y > top:
                top = y
            elif top - y > fall:
                fall = top - y
        return min(1.0, fall)

    def _levelling(self, now: float, fits: list[Fit]) -> tuple[float, float]:
        """Where a climb that is slowing down would level off, from the pace of the last
        half of the widest window up to a minute against the pace of its first half. A climb
        that levels off exponentially (a cache filling, weights loading) slows by the same
        factor every such span: its pace falls at a rate 1/tau, and it will level off at
        the level now plus its pace times tau. A leak keeps its pace and never levels off.
        Returns (1 - that level, clipped to [-1, 1], -1 when the pace is not falling; the
        rate in 1/min, 0 when it is not falling)."""
        half = 30.0 if fits[2].valid else 15.0
        if not fits[1 if half == 15.0 else 2].valid:
            return -1.0, 0.0
        t = self.t
        old = self._slope(bisect.bisect_left(t, now - 2 * half), bisect.bisect_left(t, now - half))
        new = self._slope(bisect.bisect_left(t, now - half), len(t), now)
        if new <= MIN_SLOPE or old <= new:
            return -1.0, 0.0
        rate = math.log(old / new) / half  # per second
        pace_now = new * math.exp(-rate * half / 2.0)  # the fit's pace is the half's middle's
        level_off = self.lo_now + pace_now / rate
        if level_off >= 2.0:  # slowing so little it would not level off below twice the limit
            return -1.0, 0.0
        return min(1.0, 1.0 - level_off), min(10.0, rate * 60.0)

    def _slope(self, first: int, end: int, now: float | None = None) -> float:
        """The least-squares slope of the buckets first..end-1 (and the one being filled,
        when ``now`` is given), from the running sums."""
        c, sx, sxx, sy, sxy = (col[end] - col[first] for col in self._sums[:5])
        if now is not None:
            x = now - self._anchor
            y = self.lo_now
            c, sx, sxx, sy, sxy = c + 1, sx + x, sxx + x * x, sy + y, sxy + x * y
        if c < 3:
            return 0.0
        vtt = sxx - sx * sx / c
        return (sxy - sx * sy / c) / vtt if vtt > 0 else 0.0

    @staticmethod
    def _projection(fits: list[Fit], headroom: float) -> tuple[float, float, float]:
        """(projected, earliest, latest) time to the limit, squashed, at the recent pace: the
        30 s fit (else the 15 s one) projects; the earliest takes the lower of the 15 s and
        30 s fits' upper bounds (a climb that is levelling off is judged by how fast it
        rises now, not by the steep start a longer window still holds); the latest, the 30 s
        fit's lower bound."""
        recent = [f for f in fits[:2] if f.valid]
        if not recent:  # less than 15 s of history: the longest fit that shows growth
            recent = [max((f for f in fits if f.growing), key=lambda f: f.span_s)]
        pace = recent[-1]
        upper = min(f.slope + 2.0 * f.se for f in recent)
        lower = pace.slope - 2.0 * pace.se

        def at(slope: float) -> float:
            return squash_s(headroom / slope) if slope > MIN_SLOPE else 1.0

        return at(pace.slope), at(upper), at(lower)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sec": self.sec, "lo_now": self.lo_now, "hi_now": self.hi_now,
            "t": list(self.t), "lo": list(self.lo), "hi": list(self.hi),
            "growth_since": self.growth_since, "features": list(self.features),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: Any) -> GrowthTracker:
        from oomcast.model.embedding import finite_number

        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError("growth: must be an object")
        cols = []
        for key in ("t", "lo", "hi"):
            values = data.get(key)
            if not isinstance(values, list) or len(values) > HISTORY_S + 2:
                raise ValueError(f"growth.{key}: must be a list of at most {HISTORY_S + 2}")
            cols.append(array("d", (finite_number(v, f"growth.{key}") for v in values)))
        if not len(cols[0]) == len(cols[1]) == len(cols[2]):
            raise ValueError("growth: t, lo and hi must be as long as each other")
        feats = data.get("features")
        if not isinstance(feats, list) or len(feats) != N_GROWTH:
            raise ValueError(f"growth.features: must be a list of {N_GROWTH} numbers")
        sec = data.get("sec")
        since = data.get("growth_since")
        return cls(
            sec=None if sec is None else int(finite_number(sec, "growth.sec")),
            lo_now=finite_number(data.get("lo_now"), "growth.lo_now"),
            hi_now=finite_number(data.get("hi_now"), "growth.hi_now"),
            t=cols[0], lo=cols[1], hi=cols[2],
            growth_since=None if since is None else finite_number(since, "growth.growth_since"),
            features=[finite_number(v, "growth.features") for v in feats],
        )  # fmt: skip


def _pct(slope: float) -> float:
    return max(-10.0, min(10.0, slope * 100.0))


def idle_features() -> list[float]:
    """The features of a domain with no history: no slope, no growth, nothing in sight."""
    return [*(0.0 for _ in WINDOWS_S), *(10.0 for _ in WINDOWS_S), 1.0, 1.0, 1.0, 0.0, 0.0,
            -1.0, 0.0, 0.0, 0.0, 10.0]  # fmt: skip
