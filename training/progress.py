"""Progress bars for the long commands (simulate, evaluate), on stderr, only when asked and
only where tqdm is installed (the ``train`` extra): a missing bar never fails a command."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def bar(items: Iterable[T], *, total: int | None, desc: str, unit: str, show: bool) -> Iterator[T]:
    if not show:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from items
        return
    yield from tqdm(items, total=total, desc=desc, unit=unit, dynamic_ncols=True)
