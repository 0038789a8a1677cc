"""Why an OOM is coming, and what would fix it: the ``cause`` and ``remedies`` of an alert.

An alert that only says "87% likely within 2 minutes" leaves the person paged to find out
why. :func:`diagnose` reads the evidence the service already holds for a domain (its recent
history of use, its newest sample with the allocator's figures where the hook sends them,
and a phase forecast's cause) and names one cause:

- ``phase:<name>`` (a scheduled eval, checkpoint or optimizer step that will not fit),
  given by the phase forecaster and kept as is;
- ``fragmentation``: the caching allocator holds memory it cannot hand out, (reserved -
  allocated) / reserved above 0.15 near the limit, or its retry counter climbing;
- ``growing_cache``: reserved memory grows while live tensors do not (GPU), or the cgroup's
  use grows while its anonymous memory does not (page cache);
- ``batch_growth``: use rises in steps (a longer sequence, a bigger batch) rather than
  smoothly;
- ``leak``: use rises steadily, step after step;
- ``neighbour``: another process on the GPU grew (``neighbour_bytes``, from per-process use);
- ``unknown``: too little history or no clear shape; ``thin`` then says what is missing.

Each cause comes with remedies that fit it, worded as actions, and with the limit change
that would fit the observed peak where the domain is a container. Pure and clock-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from oomcast.model.schema import Sample

FRAG_SHARE = 0.15  # (reserved - allocated) / reserved above which the cache is fragmented
NEAR_LIMIT = 0.5  # reserved / total from which fragmentation can cause the OOM (an alert
# fires minutes ahead, often with the GPU half full: from there a third of the reserve
# cached and free is what the growth to come cannot use)
MIN_POINTS = 8  # history points needed to judge a shape
MIN_SPAN_S = 10.0  # seconds of history needed to judge a shape
STEPPY = 0.6  # share of the rise made by the few largest jumps that makes it "in steps"
LIMIT_MARGIN = 1.2  # a container limit that fits the observed peak with 20% to spare
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
# every cause diagnose() names; a phase's is "phase:<name>" (phase:eval, phase:checkpoint, ...)
CAUSES = ("leak", "growing_cache", "fragmentation", "batch_growth", "phase", "neighbour", "unknown")


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    remedies: tuple[str, ...]
    evidence: str  # one sentence: what the cause was read from
    thin: tuple[str, ...] = field(default=())  # what evidence was missing


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _fragmented(last: Sample, retries_before: int | None) -> str | None:
    """The evidence of fragmentation in the newest sample, or None."""
    res, alloc = last.reserved_bytes, last.allocated_bytes
    if res and alloc is not None and res > 0:
        share = (res - alloc) / res
        if share > FRAG_SHARE and res >= NEAR_LIMIT * last.total_bytes:
            return (
                f"{share:.0%} of the {_gib(res)} the allocator reserved is cached but not"
                f" in use, with the GPU {res / last.total_bytes:.0%} reserved"
            )
    if last.alloc_retries is not None and retries_before is not None:
        climbed = last.alloc_retries - retries_before
        if climbed > 0:
            return f"the allocator freed its cache and retried {climbed} times (num_alloc_retries)"
    return None


def _shape(ts: np.ndarray, used: np.ndarray) -> tuple[str | None, str]:
    """``leak`` or ``batch_growth`` from the use over time, or None when it is not rising."""
    rise = float(used[-1] - used[0])
    if rise <= 0:
        return None, "use is not rising over the history held"
    jumps = np.diff(used)
    up = np.sort(jumps[jumps > 0])[::-1]
    few = max(1, len(jumps) // 10)  # the largest tenth of the intervals
    share = float(up[:few].sum()) / float(up.sum()) if up.size else 0.0
    rate = rise / max(float(ts[-1] - ts[0]), 1e-9)
    if share >= STEPPY:
        return "batch_growth", (
            f"use rose {_gib(rise)} in a few jumps ({share:.0%} of the rise in"
            f" {few} of {len(jumps)} intervals)"
        )
    return "leak", f"use rose steadily, {_gib(rate * 60)} a minute over {ts[-1] - ts[0]:.0f} s"


def _limit_remedy(last: Sample, peak: int) -> str:
    want = int(peak * LIMIT_MARGIN)
    return (
        f"if the job needs this memory, raise the container's limit (memory.max, or the pod's"
        f" resources.limits.memory) to at least {_gib(want)}: the peak it needs,"
        f" {_gib(peak)}, plus 20%; it is {_gib(last.total_bytes)} now"
    )


REMEDIES: dict[str, tuple[str, ...]] = {
    "fragmentation": (
        f"set {EXPANDABLE} in the job's environment: segments grow in place instead of splitting",
        "call torch.cuda.empty_cache() at phase boundaries (after eval, before a checkpoint)",
    ),
    "leak": (
        "look for tensors kept across steps: a loss summed without .item() or .detach(),"
        " outputs appended to a list, a growing cache dict",
        "the diagnosis bundle the hook saved (oomcast explain) lists the allocation sites"
        " that grew most since its last baseline, and the largest live ones",
    ),
    "growing_cache": (
        "the cached memory is reusable: torch.cuda.empty_cache() at phase boundaries, or cap"
        " it with PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.8",
    ),
    "batch_growth": (
        "cap the sequence length or bucket batches by length, so the longest batch is bounded",
        "lower the batch size and keep the effective batch with gradient accumulation",
    ),
    "phase:eval": (
        "run eval under torch.no_grad() (or torch.inference_mode()) and with a smaller eval batch",
        "checkpoint now: the eval is the step that will not fit",
    ),
    "phase:checkpoint": (
        "save checkpoints from CPU copies (state_dict moved with .cpu(), or torch.save of the"
        " on-device tensors, which copies them one by one)",
    ),
    "phase:optimizer": (
        "the optimizer's state does not fit: a lighter optimizer (SGD, 8-bit Adam), optimizer"
        " state offloaded to the CPU, or a smaller model per GPU (sharding)",
    ),
    "phase:arrival": (
        "a job announced to start on this GPU (POST /v1/admit) will not fit beside this one:"
        " place it on another GPU, or checkpoint this job before it lands",
    ),
    "neighbour": (
        "another process on this GPU is growing: move one of the jobs, or give each its"
        " share (torch.cuda.set_per_process_memory_fraction)",
    ),
    "unknown": ("watch the domain's page; the diagnosis bundle (oomcast explain) says more",),
}
# in place of a remedy that reads a bundle, where no in-job hook writes one
NO_HOOK_REMEDY = (
    "add oomcast's in-job hook (docs/collectors.md) to the training script: its diagnosis"
    " bundles name the allocation sites that grew (oomcast explain)"
)


def _missing_figures(last: Sample, host: bool) -> list[str]:
    if last.allocated_bytes is not None:
        return []
    if host:
        return ["no anonymous-memory figure: page cache cannot be told from the job's own"]
    return ["no allocator figures (no in-job hook): fragmentation cannot be judged"]


def diagnose(
    last: Sample,
    ts: np.ndarray,
    used: np.ndarray,
    *,
    phase_cause: str | None = None,
    retries_before: int | None = None,
    neighbour_bytes: int | None = None,
    anon_before: int | None = None,
    phase_extra_bytes: int | None = None,
) -> Diagnosis:
    """The cause of a domain's coming OOM and what fixes it. ``ts``/``used`` are its recent
    history (oldest first, the newest sample included); ``retries_before`` the allocator's
    retry count when the domain was first seen; ``anon_before`` its ``allocated_bytes``
    (anonymous memory, on a container) at the start of that history; ``neighbour_bytes``
    how much other processes on the GPU grew over it; ``phase_extra_bytes`` what the coming
    phase needs above the current use (a container's limit must fit that, not the past)."""
    thin: list[str] = []
    peak = int(max(int(used.max()) if used.size else 0, last.peak_bytes or 0, last.used_bytes))
    if phase_extra_bytes is not None:
        peak = max(peak, last.used_bytes + phase_extra_bytes)
    host = last.kind == "host"

    # The in-job hook counts steps (and on a GPU reads the allocator); NVML and the cgroup
    # reader do neither. Without it there is no bundle to read and no allocator to judge.
    hooked = last.step is not None or (not host and last.allocated_bytes is not None)

    def done(cause: str, evidence: str) -> Diagnosis:
        remedies = list(REMEDIES.get(cause, REMEDIES["unknown"]))
        if not hooked:
            remedies = [NO_HOOK_REMEDY if "bundle" in r else r for r in remedies]
        # page cache is reclaimed: no limit change; nor when the limit already has room
        if host and cause != "growing_cache" and peak * LIMIT_MARGIN > last.total_bytes:
            remedies.append(_limit_remedy(last, peak))
        return Diagnosis(cause, tuple(remedies), evidence, tuple(thin))

    if phase_cause == "phase:arrival":
        return done(phase_cause, "an arrival announced on this GPU will not fit beside its use")
    if phase_cause is not None and phase_cause.startswith("phase:"):
        return done(phase_cause, f"the job's schedule: the next {phase_cause[6:]} will not fit")
    frag = None if host else _fragmented(last, retries_before)
    if frag is not None:
        return done("fragmentation", frag)
    if neighbour_bytes is not None and neighbour_bytes > 0.5 * max(1, peak - int(used[0])):
        return done("neighbour", f"other processes on the GPU grew {_gib(neighbour_bytes)}")
    thin += _missing_figures(last, host)
    if ts.size < MIN_POINTS or float(ts[-1] - ts[0]) < MIN_SPAN_S:
        thin.append(f"only {ts.size} samples over {float(ts[-1] - ts[0]) if ts.size else 0:.0f} s")
        return done("unknown", "too little history to read a shape")
    if host and last.allocated_bytes is not None and anon_before is not None:
        anon_rise = last.allocated_bytes - anon_before
        if anon_rise <= 0.2 * max(1.0, float(used[-1] - used[0])):
            return done(
                "growing_cache",
                "the cgroup's use grows while its anonymous memory does not: page cache,"
                " which the kernel reclaims before it kills",
            )
    if not host and last.reserved_bytes is not None and last.allocated_bytes is not None:
        cached = last.reserved_bytes - last.allocated_bytes
        if cached > 0.5 * max(1.0, float(used[-1] - used[0])) and cached > FRAG_SHARE * peak:
            return done(
                "growing_cache",
                f"{_gib(cached)} reserved by the allocator is not in live tensors",
            )
    cause, evidence = _shape(ts, used)
    if cause is None:
        return done("unknown", evidence)
    return done(cause, evidence)
