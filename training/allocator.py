"""A pure-Python simulator of PyTorch's CUDA caching allocator (one device, one stream).

It follows ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``) and its newer
generic form ``c10/core/CachingDeviceAllocator.h`` closely enough that, for the same sequence of
requests and the same memory limit, it makes the same decisions: which cached block serves a
request, when a block is split, when a new segment is ``cudaMalloc``-ed (or, with expandable
segments, when pages are mapped), when cached memory is released, and when an allocation fails.

What is modelled, with the names used in the C++ source:

* ``round_size``: requests below 512 B (``kMinBlockSize``) become 512 B, others are rounded up to
  a multiple of 512 B (``roundup_power2_divisions`` is not modelled).
* ``get_pool``: rounded sizes up to 1 MiB (``kSmallSize``) go to the small pool, the rest to the
  large pool. Free blocks of each pool sit in a list sorted by ``(size, address)``, like the
  ``std::set`` ordered by ``BlockComparatorSize``.
* ``get_allocation_size``: a new segment is 2 MiB (``kSmallBuffer``) for the small pool, 20 MiB
  (``kLargeBuffer``) for large requests under 10 MiB (``kMinLargeAlloc``), otherwise the request
  rounded up to 2 MiB (``kRoundLarge``).
* ``get_free_block``: best fit (smallest block that is big enough, lowest address on ties), then
  the ``max_split_size`` rules: a request below ``max_split_size`` never takes a block of at least
  ``max_split_size``, and a request of at least ``max_split_size`` only takes a block smaller than
  ``request + max_non_split_rounding_size`` (20 MiB unless changed).
* ``should_split``: a block is split when the rest is at least 512 B in the small pool or with
  expandable segments; in the large pool otherwise only when the rest exceeds 1 MiB *and the
  request* is below ``max_split_size``.
* ``free_block``: the freed block merges with free neighbours of the same segment only.
* ``malloc``'s miss path: ``alloc_block`` (new segment, or mapping pages), then
  ``release_available_cached_blocks`` (only with ``max_split_size``) and ``alloc_block`` again,
  then ``release_cached_blocks`` (what ``empty_cache`` does) and a counted retry
  (``num_alloc_retries``), then the out-of-memory error (``num_ooms``).
* Expandable segments: one segment of virtual address space per pool (1 1/8 of the device's
  memory), mapped in pages of 2 MiB (small pool) or 20 MiB (large pool); ``get_free_block``'s
  "expandable size" best fit, ``find_expandable_block`` (lowest address where free plus unmapped
  space fits), ``map_block`` and ``unmap_block`` (releasing cached memory unmaps every whole page
  inside a free block, at the end of the segment or between live blocks).

A ``cudaMalloc`` or a page mapping succeeds when ``reserved + size <= capacity_bytes``.
Simulated addresses only grow, so a new segment always lies above every existing one; addresses
matter only to break ties between free blocks of equal size.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from operator import index
from typing import Any

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "AllocatorStats",
    "CachingAllocatorSim",
    "SimOutOfMemory",
    "allocation_size",
    "format_size",
    "round_size",
]

MIB = 1 << 20
K_MIN_BLOCK_SIZE = 512  # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = MIB  # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MIB  # "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20 * MIB  # "large" allocations may be packed in 20 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MIB  # allocations between 1 and 10 MiB may use K_LARGE_BUFFER
K_ROUND_LARGE = 2 * MIB  # round up large allocations to 2 MiB

# Free blocks are keyed ``size << _SHIFT | address`` in per-pool sorted lists of ints.
_SHIFT = 64
_MASK = (1 << _SHIFT) - 1
_NO_LIMIT = 1 << _SHIFT  # max_split_size "unset" (SIZE_MAX in the C++ source)
_BASE_ADDRESS = 0x7F00_0000_0000  # first simulated segment address (2 MiB aligned)

# Block states
_FREE = 0  # mapped and free: in a pool's sorted free list
_ALLOC = 1  # handed out to a live handle
_UNMAPPED = 2  # expandable segments only: reserved address space without physical pages

_SMALL = 0
_LARGE = 1


def round_size(size: int) -> int:
    """``round_size`` without ``roundup_power2_divisions``."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return (size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE * K_MIN_BLOCK_SIZE


def allocation_size(rounded: int) -> int:
    """``get_allocation_size``: bytes a non-expandable miss asks cudaMalloc for."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (rounded + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


def format_size(size: int) -> str:
    """The C++ allocator's ``format_size`` (two decimals, binary units)."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


class SimOutOfMemory(MemoryError):
    """Raised like ``torch.OutOfMemoryError`` when every step of the miss path failed."""

    def __init__(
        self,
        message: str,
        *,
        requested_bytes: int,
        alloc_size: int,
        capacity_bytes: int,
        reserved_bytes: int,
        allocated_bytes: int,
    ) -> None:
        super().__init__(message)
        self.requested_bytes = requested_bytes
        self.alloc_size = alloc_size
        self.capacity_bytes = capacity_bytes
        self.reserved_bytes = reserved_bytes
        self.allocated_bytes = allocated_bytes


@dataclass(frozen=True)
class AllocatorStats:
    allocated_bytes: int  # sum of rounded sizes of live blocks ("allocated_bytes.all.current")
    reserved_bytes: int  # sum of segment sizes / mapped pages ("reserved_bytes.all.current")
    active_bytes: int  # == allocated here (one stream, no record_stream)
    inactive_split_bytes: int  # free blocks in split segments; 0 with expandable segments (torch)
    requested_bytes: int  # sum of unrounded requested sizes of live blocks
    peak_allocated_bytes: int  # since construction or the last reset_peak_stats()
    peak_reserved_bytes: int
    num_alloc_retries: int  # cumulative
    num_ooms: int  # cumulative
    segments: int  # segments as torch.cuda.memory_snapshot() lists them (see CachingAllocatorSim)


class _Segment:
    """One cudaMalloc-ed segment, or one expandable segment's address range."""

    __slots__ = ("base", "mapped", "page", "pool", "size")

    def __init__(self, base: int, size: int, pool: int, page: int) -> None:
        self.base = base
        self.size = size  # cudaMalloc size, or the whole virtual range if expandable
        self.pool = pool
        self.page = page  # 0 for a cudaMalloc segment
        self.mapped = 0  # expandable only: bytes of mapped pages


class _Block:
    __slots__ = ("handle", "next", "pool", "prev", "ptr", "requested", "seg", "size", "state")

    def __init__(
        self,
        ptr: int,
        size: int,
        pool: int,
        state: int,
        prev: _Block | None,
        next_: _Block | None,
        seg: _Segment,
    ) -> None:
        self.ptr = ptr
        self.size = size
        self.pool = pool
        self.state = state
        self.prev = prev
        self.next = next_
        self.seg = seg
        self.requested = 0
        self.handle = 0


def _snapshot_segment(
    seg: _Segment, blocks: list[_Block], frames: Callable[[int], list[dict[str, Any]]] | None
) -> dict[str, Any]:
    """One segment of :meth:`CachingAllocatorSim.memory_snapshot` (consecutive blocks)."""
    out = []
    for b in blocks:
        live = b.state == _ALLOC
        out.append(
            {
                "address": b.ptr,
                "size": b.size,
                "requested_size": b.requested if live else 0,
                "state": "active_allocated" if live else "inactive",
                "frames": frames(b.handle) if live and frames is not None else [],
            }
        )
    allocated = sum(b.size for b in blocks if b.state == _ALLOC)
    return {
        "address": blocks[0].ptr,
        "total_size": sum(b.size for b in blocks),
        "stream": 0,
        "segment_type": "small" if seg.pool == _SMALL else "large",
        "segment_pool_id": (0, 0),
        "allocated_size": allocated,
        "active_size": allocated,
        "blocks": out,
    }


def _need(cond: bool, msg: str) -> None:
    """An invariant of :meth:`CachingAllocatorSim.check_invariants`."""
    if not cond:
        raise AssertionError(msg)


@dataclass
class _SegmentSums:
    """What check_invariants adds up over one segment."""

    blocks: int = 0
    allocated: int = 0
    requested: int = 0
    reserved: int = 0
    inactive: int = 0


def _check_mib_option(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes, got {value!r}")
    if value < K_LARGE_BUFFER or value % MIB:
        # torch parses these options in whole MiB and refuses values under 20 MiB
        raise ValueError(f"{name} must be a whole number of MiB and at least 20 MiB, got {value}")
    return value


class CachingAllocatorSim:
    """Simulated ``DeviceCachingAllocator`` for one device and one stream.

    ``capacity_bytes`` is the memory the allocator may reserve; it may be changed between calls
    (other processes come and go). Reserved memory above a lowered capacity stays until freed.

    ``max_non_split_rounding_size`` (torch's ``max_non_split_rounding_mb``) and
    ``device_total_bytes`` (the device's total memory, which sizes an expandable segment's
    virtual range; default: the initial capacity) are optional extras.

    ``stats().segments`` counts what ``torch.cuda.memory_snapshot()`` lists as segments: the
    cudaMalloc-ed segments, or with expandable segments each contiguous mapped range. (torch's own
    ``segment.all.current`` counter stays 0 with expandable segments.)
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        max_split_size: int | None = None,
        expandable_segments: bool = False,
        max_non_split_rounding_size: int = K_LARGE_BUFFER,
        device_total_bytes: int | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if max_split_size is not None:
            _check_mib_option("max_split_size", max_split_size)
        _check_mib_option("max_non_split_rounding_size", max_non_split_rounding_size)
        self.capacity_bytes = capacity_bytes
        self.max_split_size = max_split_size
        self.max_non_split_rounding_size = max_non_split_rounding_size
        self.expandable_segments = bool(expandable_segments)
        total = capacity_bytes if device_total_bytes is None else device_total_bytes
        if total < 0:
            raise ValueError(f"device_total_bytes must be >= 0, got {total}")
        self.device_total_bytes = total

        self._mss = _NO_LIMIT if max_split_size is None else max_split_size
        self._mnsrs = max_non_split_rounding_size
        self._expandable = self.expandable_segments
        # ExpandableSegment: address space for 1 1/8 of the device memory, in pages
        va = total + total // 8
        self._va_pages = (
            max(1, -(-va // K_SMALL_BUFFER)),
            max(1, -(-va // K_LARGE_BUFFER)),
        )

        self._keys: tuple[list[int], list[int]] = ([], [])  # free blocks, sorted size<<64|ptr
        self._free: dict[int, _Block] = {}  # ptr -> free (mapped) block
        self._unmapped_ptrs: tuple[list[int], list[int]] = ([], [])  # sorted addresses
        self._unmapped: dict[int, _Block] = {}  # ptr -> unmapped block
        self._live: dict[int, _Block] = {}  # handle -> allocated block
        self._zero: set[int] = set()  # live handles of size-0 requests
        self._segments: dict[int, _Segment] = {}  # base address -> segment
        self._next_handle = 1
        self._next_address = _BASE_ADDRESS

        self._allocated = 0
        self._requested = 0
        self._reserved = 0
        self._inactive_split = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._num_alloc_retries = 0
        self._num_ooms = 0

    # ------------------------------------------------------------------ public API

    def malloc(self, size: int) -> int:
        """Allocate ``size`` bytes and return an opaque handle (raises SimOutOfMemory)."""
        if type(size) is not int:
            size = index(size)  # numpy integers would overflow in the sort keys; floats raise
        if size <= 0:
            if size < 0:
                raise ValueError(f"size must be >= 0, got {size}")
            # torch's allocate() never calls the device allocator for 0 bytes
            handle = self._next_handle
            self._next_handle = handle + 1
            self._zero.add(handle)
            return handle
        rsize = 512 if size < 512 else (size + 511) & -512
        pool = _SMALL if rsize <= K_SMALL_SIZE else _LARGE
        keys = self._keys[pool]
        block = None
        # get_free_block
        i = bisect_left(keys, rsize << _SHIFT)
        if i < len(keys):
            if self._expandable:
                i = self._expandable_best_fit(keys, i)
            key = keys[i]
            bsize = key >> _SHIFT
            mss = self._mss
            if (bsize < mss) if rsize < mss else (bsize < rsize + self._mnsrs):
                del keys[i]
                block = self._free.pop(key & _MASK)
        if block is None:
            block = self._allocate_on_miss(pool, rsize, size)

        # should_split + alloc_found_block
        remaining = block.size - rsize
        expandable = self._expandable
        if pool == _SMALL or expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = remaining > K_SMALL_SIZE and rsize < self._mss
        if split:
            ptr = block.ptr
            prev = block.prev
            new = _Block(ptr, rsize, pool, _ALLOC, prev, block, block.seg)
            if not expandable:
                if prev is not None or block.next is not None:
                    self._inactive_split -= rsize  # an already split free block shrinks
                else:
                    self._inactive_split += remaining  # a whole segment becomes split
            if prev is not None:
                prev.next = new
            block.prev = new
            rest = ptr + rsize
            block.ptr = rest
            block.size = remaining
            insort(self._keys[pool], (remaining << _SHIFT) | rest)
            self._free[rest] = block
            block = new
        else:
            if not expandable and (block.prev is not None or block.next is not None):
                self._inactive_split -= block.size
            block.state = _ALLOC

        handle = self._next_handle
        self._next_handle = handle + 1
        block.handle = handle
        block.requested = size
        self._live[handle] = block
        allocated = self._allocated + block.size
        self._allocated = allocated
        if allocated > self._peak_allocated:
            self._peak_allocated = allocated
        self._requested += size
        return handle

    def free(self, handle: int) -> None:
        """Return a handle's block to the cache (merging with free neighbours)."""
        block = self._live.pop(handle, None)
        if block is None:
            if handle in self._zero:
                self._zero.remove(handle)
                return
            raise ValueError(f"unknown or already freed handle {handle!r}")
        self._allocated -= block.size
        self._requested -= block.requested
        block.requested = 0
        block.handle = 0
        keys = self._keys[block.pool]
        free = self._free
        subsumed = 0
        prev = block.prev
        if prev is not None and prev.state == _FREE:
            del keys[bisect_left(keys, (prev.size << _SHIFT) | prev.ptr)]
            del free[prev.ptr]
            block.ptr = prev.ptr
            block.size += prev.size
            subsumed += prev.size
            prev = prev.prev
            block.prev = prev
            if prev is not None:
                prev.next = block
        nxt = block.next
        if nxt is not None and nxt.state == _FREE:
            del keys[bisect_left(keys, (nxt.size << _SHIFT) | nxt.ptr)]
            del free[nxt.ptr]
            block.size += nxt.size
            subsumed += nxt.size
            nxt = nxt.next
            block.next = nxt
            if nxt is not None:
                nxt.prev = block
        block.state = _FREE
        insort(keys, (block.size << _SHIFT) | block.ptr)
        free[block.ptr] = block
        if not self._expandable:
            if prev is not None or nxt is not None:
                self._inactive_split += block.size - subsumed
            else:
                self._inactive_split -= subsumed

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every fully free segment (unmap free pages)."""
        self._release_cached_blocks()

    def stats(self) -> AllocatorStats:
        if self._expandable:
            # contiguous mapped ranges: one per segment, +1 per unmapped block inside the
            # segment, -1 for an unmapped block at either end
            segments = len(self._segments)
            for block in self._unmapped.values():
                segments += 1 - (block.prev is None) - (block.next is None)
        else:
            segments = len(self._segments)
        return AllocatorStats(
            allocated_bytes=self._allocated,
            reserved_bytes=self._reserved,
            active_bytes=self._allocated,
            inactive_split_bytes=self._inactive_split,
            requested_bytes=self._requested,
            peak_allocated_bytes=self._peak_allocated,
            peak_reserved_bytes=self._peak_reserved,
            num_alloc_retries=self._num_alloc_retries,
            num_ooms=self._num_ooms,
            segments=segments,
        )

    def memory_snapshot(
        self, frames: Callable[[int], list[dict[str, Any]]] | None = None
    ) -> dict[str, Any]:
        """The layout in the format of ``torch.cuda.memory._snapshot()``: ``segments``, each
        with its ``blocks`` (``active_allocated`` or ``inactive``), and no ``device_traces``.
        An expandable segment is listed as its contiguous mapped ranges, as torch does.
        ``frames(handle)`` gives a live block's stack (``[{"filename", "line", "name"}]``)."""
        by_ptr = self._blocks_by_ptr()
        segments: list[dict[str, Any]] = []
        for base in sorted(self._segments):
            seg = self._segments[base]
            run: list[_Block] = []
            block: _Block | None = by_ptr[base]
            while block is not None:
                if block.state == _UNMAPPED:
                    if run:
                        segments.append(_snapshot_segment(seg, run, frames))
                    run = []
                else:
                    run.append(block)
                block = block.next
            if run:
                segments.append(_snapshot_segment(seg, run, frames))
        return {"segments": segments, "device_traces": [[]]}

    def reset_peak_stats(self) -> None:
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    def state_key(self) -> tuple[object, ...]:
        """Hashable fingerprint of the layout: per pool, the segments in address order, each as
        its blocks ``(size, state, handle)`` (state 0 free, 1 allocated with its handle, 2
        unmapped), plus the live size-0 handles and the configuration. Stats and absolute
        addresses are left out; equal keys and equal capacities give identical futures."""
        by_ptr = self._blocks_by_ptr()
        pools: tuple[list[tuple[tuple[int, int, int], ...]], ...] = ([], [])
        for base in sorted(self._segments):
            seg = self._segments[base]
            items: list[tuple[int, int, int]] = []
            block: _Block | None = by_ptr[base]
            while block is not None:
                items.append((block.size, block.state, block.handle))
                block = block.next
            pools[seg.pool].append(tuple(items))
        return (
            self.max_split_size,
            self._mnsrs,
            self._expandable,
            self._va_pages if self._expandable else None,
            tuple(pools[_SMALL]),
            tuple(pools[_LARGE]),
            tuple(sorted(self._zero)),
        )

    def check_invariants(self) -> None:
        """Walk every segment and cross-check all bookkeeping; raise AssertionError if wrong."""
        by_ptr = self._blocks_by_ptr()
        _need(
            len(by_ptr) == len(self._free) + len(self._unmapped) + len(self._live),
            "a block is registered twice",
        )
        seen = 0
        reserved = 0
        inactive = 0
        allocated = 0
        requested = 0
        for base, seg in self._segments.items():
            sums = self._check_segment(base, seg, by_ptr)
            seen += sums.blocks
            allocated += sums.allocated
            requested += sums.requested
            reserved += sums.reserved
            inactive += sums.inactive
        _need(seen == len(by_ptr), "blocks outside every segment")
        self._check_free_lists()
        for handle, block in self._live.items():
            _need(block.state == _ALLOC and block.handle == handle, "live handle mismatch")
        _need(not (self._zero & self._live.keys()), "handle both zero-size and live")
        _need(allocated == self._allocated, f"allocated {self._allocated} != {allocated}")
        _need(requested == self._requested, f"requested {self._requested} != {requested}")
        _need(reserved == self._reserved, f"reserved {self._reserved} != {reserved}")
        _need(inactive == self._inactive_split, f"inactive {self._inactive_split} != {inactive}")
        _need(self._reserved >= self._allocated, "reserved below allocated")
        _need(self._peak_allocated >= self._allocated, "peak allocated below current")
        _need(self._peak_reserved >= self._reserved, "peak reserved below current")

    def _check_segment(self, base: int, seg: _Segment, by_ptr: dict[int, _Block]) -> _SegmentSums:
        """check_invariants for one segment and its blocks, in address order."""
        _need(seg.base == base, "segment keyed under the wrong address")
        _need(base in by_ptr, f"segment {base:#x} has no head block")
        block: _Block | None = by_ptr[base]
        _need(block is not None and block.prev is None, "segment head has a predecessor")
        sums = _SegmentSums()
        pos = base
        total = 0
        mapped = 0
        prev: _Block | None = None
        while block is not None:
            sums.blocks += 1
            self._check_block(block, seg, base, pos, prev, by_ptr)
            if block.state == _ALLOC:
                sums.allocated += block.size
                sums.requested += block.requested
            if block.state != _UNMAPPED:
                mapped += block.size
            total += block.size
            pos += block.size
            prev = block
            block = block.next
        _need(total == seg.size, f"blocks of segment {base:#x} sum to {total}, not {seg.size}")
        if self._expandable:
            _need(seg.page > 0, "expandable segment without page size")
            _need(mapped == seg.mapped, "mapped bytes disagree with the segment")
            _need(mapped % seg.page == 0, "partial page mapped")
            sums.reserved = mapped
        else:
            _need(seg.page == 0, "cudaMalloc segment with a page size")
            sums.reserved = seg.size
            if sums.blocks > 1:
                b2: _Block | None = by_ptr[base]
                while b2 is not None:
                    if b2.state == _FREE:
                        sums.inactive += b2.size
                    b2 = b2.next
        return sums

    def _check_block(
        self,
        block: _Block,
        seg: _Segment,
        base: int,
        pos: int,
        prev: _Block | None,
        by_ptr: dict[int, _Block],
    ) -> None:
        """check_invariants for one block of ``seg``, expected at ``pos`` after ``prev``."""
        _need(block.ptr == pos, f"block at {block.ptr:#x} expected at {pos:#x}")
        _need(block.seg is seg, "block points to another segment")
        _need(block.pool == seg.pool, "block pool differs from its segment's")
        _need(block.prev is prev, "broken prev link")
        _need(block.size > 0 and block.size % K_MIN_BLOCK_SIZE == 0, "bad block size")
        _need(by_ptr.get(block.ptr) is block, "block missing from its registry")
        if prev is not None:
            _need(
                not (prev.state == block.state and block.state != _ALLOC),
                "two adjacent free (or unmapped) blocks were not merged",
            )
        state = block.state
        if state == _FREE:
            _need(self._free.get(block.ptr) is block, "free block not in the free map")
            _need(block.handle == 0, "free block keeps a handle")
        elif state == _ALLOC:
            _need(self._live.get(block.handle) is block, "allocated block without handle")
            _need(0 < block.requested <= block.size, "requested size out of range")
            _need(round_size(block.requested) <= block.size, "block smaller than request")
        else:
            _need(self._expandable, "unmapped block outside an expandable segment")
            _need(self._unmapped.get(block.ptr) is block, "unmapped block not registered")
            _need(
                (block.ptr - base) % seg.page == 0 and block.size % seg.page == 0,
                "unmapped block not page aligned",
            )

    def _check_free_lists(self) -> None:
        """check_invariants for the sorted free-block keys and unmapped addresses per pool."""
        for pool in (_SMALL, _LARGE):
            keys = self._keys[pool]
            _need(all(a < b for a, b in pairwise(keys)), "free list unsorted")
            for key in keys:
                block = self._free.get(key & _MASK)
                _need(block is not None, "free key without block")
                assert block is not None
                _need(block.pool == pool and block.size == key >> _SHIFT, "stale free key")
            ptrs = self._unmapped_ptrs[pool]
            _need(ptrs == sorted(ptrs), "unmapped list unsorted")
            for ptr in ptrs:
                _need(ptr in self._unmapped and self._unmapped[ptr].pool == pool, "stale ptr")
        _need(len(self._keys[0]) + len(self._keys[1]) == len(self._free), "free map/list mismatch")
        _need(
            len(self._unmapped_ptrs[0]) + len(self._unmapped_ptrs[1]) == len(self._unmapped),
            "unmapped map/list mismatch",
        )

    # ------------------------------------------------------------------ internals

    def _blocks_by_ptr(self) -> dict[int, _Block]:
        by_ptr = dict(self._free)
        by_ptr.update(self._unmapped)
        for block in self._live.values():
            by_ptr[block.ptr] = block
        return by_ptr

    def _bump(self, size: int) -> int:
        base = self._next_address
        self._next_address = base + (size + K_SMALL_BUFFER - 1) // K_SMALL_BUFFER * K_SMALL_BUFFER
        if self._next_address > _MASK:
            raise OverflowError("simulated address space exhausted")
        return base

    def _expandable_best_fit(self, keys: list[int], i: int) -> int:
        """get_free_block with expandable segments: a block followed by unmapped space counts
        as that much bigger, so move on while the next block is 'smaller' than the current."""
        free = self._free
        block = free[keys[i] & _MASK]
        nxt = block.next
        size = block.size + (nxt.size if nxt is not None and nxt.state == _UNMAPPED else 0)
        n = len(keys)
        while i + 1 < n:
            cand = free[keys[i + 1] & _MASK]
            nxt = cand.next
            csize = cand.size + (nxt.size if nxt is not None and nxt.state == _UNMAPPED else 0)
            if csize >= size:
                break
            i += 1
            size = csize
        return i

    def _allocate_on_miss(self, pool: int, rsize: int, orig: int) -> _Block:
        alloc_size = allocation_size(rsize)
        block = self._alloc_block(pool, rsize, alloc_size)
        if (
            block is None
            and self.max_split_size is not None
            and self._release_available_cached_blocks(pool, rsize)
        ):
            block = self._alloc_block(pool, rsize, alloc_size)
        if block is None:
            self._release_cached_blocks()
            self._num_alloc_retries += 1
            block = self._alloc_block(pool, rsize, alloc_size)
        if block is None:
            self._num_ooms += 1
            capacity = self.capacity_bytes
            reserved = self._reserved
            allocated = self._allocated
            raise SimOutOfMemory(
                f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU 0 has a "
                f"total capacity of {format_size(capacity)} of which "
                f"{format_size(max(0, capacity - reserved))} is free. Of the allocated memory "
                f"{format_size(allocated)} is allocated by PyTorch, and "
                f"{format_size(reserved - allocated)} is reserved by PyTorch but unallocated. "
                f"(simulated; request {orig} bytes, rounded {rsize}, "
                f"{format_size(reserved)} reserved)",
                requested_bytes=orig,
                alloc_size=alloc_size,
                capacity_bytes=capacity,
                reserved_bytes=reserved,
                allocated_bytes=allocated,
            )
        return block

    def _alloc_block(self, pool: int, rsize: int, alloc_size: int) -> _Block | None:
        """alloc_block: a new segment (not in the free lists) or None when it does not fit."""
        if self._expandable:
            return self._try_allocate_expandable_block(pool, rsize)
        if self._reserved + alloc_size > self.capacity_bytes:
            return None
        base = self._bump(alloc_size)
        seg = _Segment(base, alloc_size, pool, 0)
        self._segments[base] = seg
        reserved = self._reserved + alloc_size
        self._reserved = reserved
        if reserved > self._peak_reserved:
            self._peak_reserved = reserved
        return _Block(base, alloc_size, pool, _FREE, None, None, seg)

    def _remove_free(self, block: _Block) -> None:
        keys = self._keys[block.pool]
        del keys[bisect_left(keys, (block.size << _SHIFT) | block.ptr)]
        del self._free[block.ptr]

    def _add_free(self, block: _Block) -> None:
        insort(self._keys[block.pool], (block.size << _SHIFT) | block.ptr)
        self._free[block.ptr] = block

    def _remove_unmapped(self, block: _Block) -> None:
        ptrs = self._unmapped_ptrs[block.pool]
        del ptrs[bisect_left(ptrs, block.ptr)]
        del self._unmapped[block.ptr]

    def _add_unmapped(self, block: _Block) -> None:
        insort(self._unmapped_ptrs[block.pool], block.ptr)
        self._unmapped[block.ptr] = block

    def _release_block(self, block: _Block) -> None:
        """release_block: cudaFree a whole free segment (already out of the free lists)."""
        if block.prev is not None or block.next is not None or block.seg.page:
            raise AssertionError("release_block on a split or expandable block")
        del self._free[block.ptr]
        del self._segments[block.ptr]
        self._reserved -= block.size

    def _release_available_cached_blocks(self, pool: int, rsize: int) -> bool:
        """Free the smallest whole cached block >= max(request, max_split_size), else oversize
        blocks from the largest down until that many bytes are freed."""
        if self._expandable:
            return False  # expandable blocks are skipped; nothing else can be in the pool
        keys = self._keys[pool]
        mss = self._mss
        target = rsize if rsize > mss else mss
        i = bisect_left(keys, target << _SHIFT)
        if i < len(keys):
            key = keys.pop(i)
            self._release_block(self._free[key & _MASK])
            return True
        released = 0
        j = len(keys) - 1
        while released < target and j >= 0 and (keys[j] >> _SHIFT) >= mss:
            key = keys.pop(j)
            block = self._free[key & _MASK]
            released += block.size
            self._release_block(block)
            j -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """release_cached_blocks: large pool first, then small."""
        for pool in (_LARGE, _SMALL):
            keys = self._keys[pool]
            if self._expandable:
                for block in [self._free[key & _MASK] for key in keys]:
                    self._unmap_block(block)
                    if block.state == _UNMAPPED and block.prev is None and block.next is None:
                        self._remove_unmapped(block)
                        del self._segments[block.seg.base]
            else:
                keep = []
                for key in keys:
                    block = self._free[key & _MASK]
                    if block.prev is None and block.next is None:
                        self._release_block(block)
                    else:
                        keep.append(key)
                keys[:] = keep

    # --- expandable segments

    def _find_expandable_block(self, pool: int, size: int) -> _Block | None:
        unmapped = self._unmapped
        for ptr in self._unmapped_ptrs[pool]:
            cand = unmapped[ptr]
            prev = cand.prev
            if prev is not None and prev.state == _FREE:
                cand = prev
            room = 0
            block: _Block | None = cand
            while room < size and block is not None and block.state != _ALLOC:
                room += block.size
                block = block.next
            if room >= size:
                return cand
        page = K_SMALL_BUFFER if pool == _SMALL else K_LARGE_BUFFER
        va = self._va_pages[pool] * page
        if va < size:
            return None  # more than the whole address range (torch would fail here too)
        base = self._bump(va)
        seg = _Segment(base, va, pool, page)
        self._segments[base] = seg
        block = _Block(base, va, pool, _UNMAPPED, None, None, seg)
        self._add_unmapped(block)
        return block

    def _try_allocate_expandable_block(self, pool: int, rsize: int) -> _Block | None:
        cand = self._find_expandable_block(pool, rsize)
        if cand is None:
            return None
        if cand.state == _UNMAPPED and not self._map_block(cand, min(cand.size, rsize)):
            return None
        while cand.size < rsize:
            # free -> unmapped -> ...: map part of the unmapped block, which absorbs cand
            nxt = cand.next
            if nxt is None or nxt.state != _UNMAPPED:
                raise AssertionError("expandable candidate is not followed by unmapped space")
            if not self._map_block(nxt, min(rsize - cand.size, nxt.size)):
                return None
            cand = nxt
        self._remove_free(cand)
        return cand

    def _map_block(self, block: _Block, size: int) -> bool:
        """map_block: map whole pages covering ``size`` bytes at the start of ``block``."""
        seg = block.seg
        page = seg.page
        nbytes = -(-size // page) * page
        if self._reserved + nbytes > self.capacity_bytes:
            return False
        self._remove_unmapped(block)
        block.state = _FREE
        if nbytes < block.size:
            rest_ptr = block.ptr + nbytes
            rest = _Block(
                rest_ptr, block.size - nbytes, block.pool, _UNMAPPED, block, block.next, seg
            )
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = nbytes
            self._add_unmapped(rest)
        self._merge_neighbours(block, _FREE, self._remove_free)
        self._add_free(block)
        seg.mapped += nbytes
        reserved = self._reserved + nbytes
        self._reserved = reserved
        if reserved > self._peak_reserved:
            self._peak_reserved = reserved
        return True

    def _merge_neighbours(
        self, block: _Block, state: int, remove: Callable[[_Block], None]
    ) -> None:
        """Absorb the neighbours of ``block`` that are in ``state`` (taking them out of their
        list with ``remove``). ``free`` inlines the same for speed on the hot path."""
        prev = block.prev
        if prev is not None and prev.state == state:
            remove(prev)
            block.ptr = prev.ptr
            block.size += prev.size
            block.prev = prev.prev
            if prev.prev is not None:
                prev.prev.next = block
        nxt = block.next
        if nxt is not None and nxt.state == state:
            remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block

    def _unmap_block(self, block: _Block) -> None:
        """unmap_block: unmap every whole page inside a free block."""
        seg = block.seg
        page = seg.page
        offset = block.ptr - seg.base
        first = -(-offset // page)
        last = (offset + block.size) // page
        if first >= last:
            return
        self._remove_free(block)
        start = seg.base + first * page
        nbytes = (last - first) * page
        before = start - block.ptr
        after = block.size - before - nbytes
        if before > 0:
            head = _Block(block.ptr, before, block.pool, _FREE, block.prev, block, seg)
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            self._add_free(head)
        if after > 0:
            tail = _Block(start + nbytes, after, block.pool, _FREE, block, block.next, seg)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            self._add_free(tail)
        block.ptr = start
        block.size = nbytes
        block.state = _UNMAPPED
        self._merge_neighbours(block, _UNMAPPED, self._remove_unmapped)
        self._add_unmapped(block)
        seg.mapped -= nbytes
        self._reserved -= nbytes
