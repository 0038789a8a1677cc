"""``oomcast bench hook``: what the in-process hook's ``step()`` costs the training loop.

Run as ``python -m oomcast.bench.hook [STEPS [REDIS_URL]]`` it prints the figures
as one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import redis

from oomcast.model.jobcontrol import new_request_id
from oomcast.model.wire import redis_url_from_env


def bench_hook(
    steps: int = 20000, redis_url: str | None = None, *, key_prefix: str | None = None
) -> dict[str, float | int]:
    """Time ``step()`` in host mode, publishing to ``redis_url`` (default
    ``OOMCAST_REDIS_URL``; the keys are deleted afterwards) and with publishing off."""
    from oomcast.collectors.hook import MemoryHook  # the hook re-exports this function

    url = redis_url or redis_url_from_env()
    prefix = key_prefix or f"oomcast-bench-{new_request_id()[:8]}"
    out: dict[str, float | int] = {"steps": steps}
    for suffix, publish in (("", True), ("_no_publish", False)):
        hook = MemoryHook(
            "bench",
            redis_url=url,
            key_prefix=prefix,
            node="bench",
            mode="host",
            publish=publish,
            checkpoint_signal=None,
        )
        try:
            for _ in range(min(200, steps)):  # warm up
                hook.step()
            times = []
            clock = time.perf_counter_ns
            for _ in range(steps):
                t0 = clock()
                hook.step()
                times.append(clock() - t0)
            hook.flush(10.0)
        finally:
            hook.close(10.0)
        times.sort()
        out[f"us_per_step_p50{suffix}"] = round(times[len(times) // 2] / 1e3, 2)
        out[f"us_per_step_mean{suffix}"] = round(statistics.fmean(times) / 1e3, 2)
        out[f"us_per_step_p99{suffix}"] = round(times[int(len(times) * 0.99)] / 1e3, 2)
        out[f"us_per_step_max{suffix}"] = round(times[-1] / 1e3, 2)
        out[f"samples_queue_dropped{suffix}"] = hook.stats.queue_dropped
        if publish:
            out["records_published"] = hook.stats.records_published
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    print(
        json.dumps(bench_hook(int(args[0]) if args else 20000, args[1] if len(args) > 1 else None))
    )
