"""Per-process GPU memory in a sample: parsed the same on both paths, every bad value named,
and the growth of the GPU's other processes measured for the neighbour cause."""

from __future__ import annotations

from typing import Any

import pytest

from oomcast.model.processes import MAX_PROCESSES, ProcessUse, neighbour_growth
from oomcast.model.schema import SchemaError, _checked_sample, _fast_sample, parse_sample

GIB = 1 << 30


def raw(**extra: Any) -> dict[str, Any]:
    base = {"ts": 1.5, "node": "n", "device": "gpu0", "kind": "gpu",
            "total_bytes": 80 * GIB, "used_bytes": 40 * GIB}  # fmt: skip
    return {**base, **extra}


def test_processes_parse_alike_on_the_fast_and_the_checked_path() -> None:
    procs = [{"pid": 11, "used_bytes": 30 * GIB, "job": "train"}, {"pid": 12, "used_bytes": None}]
    fast = _fast_sample(raw(processes=procs))
    assert fast is not None and fast == _checked_sample(raw(processes=procs))
    assert fast.processes == (ProcessUse(11, 30 * GIB, "train"), ProcessUse(12, None))
    assert parse_sample(fast.to_dict()) == fast  # to_dict round-trips them
    assert (
        parse_sample(raw()).processes is None and "processes" not in parse_sample(raw()).to_dict()
    )
    whole = parse_sample(raw(processes=[{"pid": 11.0, "used_bytes": 1.6e10}]))
    assert whole.processes == (ProcessUse(11, 16_000_000_000),)


@pytest.mark.parametrize(
    ("procs", "says"),
    [
        ("x", "must be a list"),
        ([{"pid": 1, "used_bytes": 1}] * (MAX_PROCESSES + 1), f"at most {MAX_PROCESSES}"),
        ([7], "[0] must be an object"),
        ([{"pid": 7}], "[0] must be an object with pid and used_bytes"),
        ([{"pid": 0, "used_bytes": 1}], "[0].pid must be a positive integer"),
        ([{"pid": True, "used_bytes": 1}], "[0].pid must be a positive integer"),
        ([{"pid": 1, "used_bytes": -1}], "[0].used_bytes must be a byte count"),
        ([{"pid": 1, "used_bytes": 400 * GIB}], "[0].used_bytes must be a byte count"),
        ([{"pid": 1, "used_bytes": 1, "job": "a\nb"}], "[0].job must be a name"),
    ],
)
def test_bad_processes_are_named(procs: Any, says: str) -> None:
    assert _fast_sample(raw(processes=procs)) is None  # the fast path hands it over
    with pytest.raises(SchemaError, match=r"^processes: ") as err:
        parse_sample(raw(processes=procs))
    assert says in str(err.value)


def test_neighbour_growth_counts_other_jobs_and_newcomers() -> None:
    first = [ProcessUse(1, 30 * GIB, "mine")]
    later = [ProcessUse(1, 35 * GIB, "mine"), ProcessUse(2, 12 * GIB, "other")]
    assert neighbour_growth(first, later, "mine") == 12 * GIB  # my growth is not a neighbour's
    assert neighbour_growth(first, later, None) == 17 * GIB  # no job known: every growth
    grown = [ProcessUse(1, 30 * GIB, "mine"), ProcessUse(2, 20 * GIB, "other")]
    assert neighbour_growth(later, grown, "mine") == 8 * GIB
    assert (
        neighbour_growth(None, later, "mine") is None and neighbour_growth(first, None, "x") is None
    )
