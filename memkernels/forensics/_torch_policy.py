"""A model of PyTorch's caching allocator policy (``CUDACachingAllocator.cpp``, classic segments).

It is the "what PyTorch would have done" column of ``memkernels replay``: replaying a
recorded trace through this model from an empty cache must reproduce the trace's own
``segment_alloc`` sizes (see :func:`segment_match`). The rules modeled, all from PyTorch's
documentation and source, with the defaults of an empty ``PYTORCH_CUDA_ALLOC_CONF``:

* sizes round up to a multiple of 512 bytes (at least 512);
* requests of at most 1 MiB come from the *small* pool, whose segments are 2 MiB; larger
  ones from the *large* pool, whose segments are 20 MiB for requests under 10 MiB and the
  request rounded up to 2 MiB otherwise;
* best fit: the smallest cached free block of the same stream and pool that is large enough,
  lowest address among equal sizes;
* a block is split when the remainder is at least 512 bytes (small pool) or more than 1 MiB
  (large pool); with ``max_split_size`` set, blocks of that size or more are never split, are
  not used for requests below it, and are used for larger requests only if they waste less
  than 20 MiB;
* a freed block merges with free neighbours in its segment;
* when the device refuses a segment: free cached blocks of at least ``max_split_size`` first,
  then every cached free segment, and retry once before raising out-of-memory.

Pure Python: it runs a few thousand events per trace, where clarity beats speed.
"""
import bisect

KB = 1024
MB = 1024 * KB
MIN_BLOCK_SIZE = 512
SMALL_SIZE = 1 * MB
SMALL_BUFFER = 2 * MB
LARGE_BUFFER = 20 * MB
MIN_LARGE_ALLOC = 10 * MB
ROUND_LARGE = 2 * MB


class ModelOutOfMemory(Exception):
    """The modeled device refused a segment even after the cache was released."""


class _Block:
    __slots__ = ("addr", "size", "stream", "pool", "segment_addr", "prev", "next", "allocated", "mapped")

    def __init__(self, addr, size, stream, pool, segment_addr, mapped=True):
        self.addr, self.size, self.stream, self.pool = addr, size, stream, pool
        self.segment_addr = segment_addr
        self.prev = self.next = None
        self.allocated = False
        self.mapped = mapped  # False: unmapped address space of an expandable segment

    def key(self):
        return (self.stream, self.size, self.addr)


def round_size(size):
    return MIN_BLOCK_SIZE if size < MIN_BLOCK_SIZE else -(-size // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE


def segment_size(rounded):
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


class TorchPolicyModel:
    """PyTorch's caching allocator policy over a device of ``capacity`` bytes (None: unlimited).

    Addresses are virtual: segments are placed one after another and never touched.
    """

    def __init__(self, capacity=None, max_split_size=None):
        self.capacity = capacity
        self.max_split_size = max_split_size if max_split_size is not None else float("inf")
        self._free_keys = {"small": [], "large": []}  # sorted (stream, size, addr)
        self._free_blocks = {}  # (stream, size, addr) -> block
        self._allocated = {}  # addr -> block
        self._next_addr = 1 << 40
        self.segment_sizes = []  # every segment_alloc, in order
        self.live_segments = {}  # address -> size of the segments held now (classic)
        self.reserved = self.peak_reserved = 0
        self.allocated = self.peak_allocated = 0
        self.num_device_alloc = self.num_device_free = 0
        self.num_alloc_retries = self.num_ooms = 0

    # free-block index -------------------------------------------------------------
    def _insert_free(self, block):
        key = block.key()
        bisect.insort(self._free_keys[block.pool], key)
        self._free_blocks[key] = block

    def _remove_free(self, block):
        key = block.key()
        keys = self._free_keys[block.pool]
        del keys[bisect.bisect_left(keys, key)]
        del self._free_blocks[key]

    def _find_free(self, pool, stream, size):
        keys = self._free_keys[pool]
        i = bisect.bisect_left(keys, (stream, size, -1))
        if i == len(keys) or keys[i][0] != stream:
            return None
        block = self._free_blocks[keys[self._best_fit(keys, i, stream)]]
        if size < self.max_split_size <= block.size:
            return None  # oversize blocks only serve oversize requests
        if size >= self.max_split_size and block.size >= size + LARGE_BUFFER:
            return None  # ... and only when they waste less than 20 MiB
        return block

    def _best_fit(self, keys, i, stream):
        """Index of the chosen free block, given the smallest one that fits (``keys[i]``)."""
        return i

    def _should_split(self, pool, rounded, remaining):
        if pool == "small":
            return remaining >= MIN_BLOCK_SIZE
        return rounded < self.max_split_size and remaining > SMALL_SIZE

    # device -----------------------------------------------------------------------
    def _device_alloc(self, size):
        if self.capacity is not None and self.reserved + size > self.capacity:
            return None
        addr = self._next_addr
        self._next_addr += size
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.num_device_alloc += 1
        self.segment_sizes.append(size)
        self.live_segments[addr] = size
        return addr

    def _release_segment(self, block):
        self._remove_free(block)
        del self.live_segments[block.addr]
        self.reserved -= block.size
        self.num_device_free += 1

    def _release_cached(self, min_size=0):
        for pool in ("small", "large"):
            for key in list(self._free_keys[pool]):
                block = self._free_blocks[key]
                whole_segment = block.prev is None and block.next is None
                if whole_segment and block.size >= min_size:
                    self._release_segment(block)

    def empty_cache(self):
        self._release_cached()

    # public -----------------------------------------------------------------------
    def malloc(self, size, stream=0):
        rounded = round_size(size)
        pool = "small" if rounded <= SMALL_SIZE else "large"
        block = self._find_free(pool, stream, rounded)
        if block is not None:
            self._remove_free(block)
        else:
            block = self._new_segment(pool, stream, rounded, size)
        remaining = block.size - rounded
        if self._should_split(pool, rounded, remaining):
            rest = _Block(block.addr + rounded, remaining, stream, pool, block.segment_addr)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = rounded
            self._insert_free(rest)
        block.allocated = True
        self._allocated[block.addr] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.addr

    def _new_segment(self, pool, stream, rounded, requested):
        alloc_size = segment_size(rounded)
        addr = self._device_alloc(alloc_size)
        if addr is None and self.max_split_size != float("inf"):
            self._release_cached(min_size=self.max_split_size)
            addr = self._device_alloc(alloc_size)
        if addr is None:
            self.num_alloc_retries += 1
            self._release_cached()
            addr = self._device_alloc(alloc_size)
        if addr is None:
            self.num_ooms += 1
            raise ModelOutOfMemory(
                f"modeled PyTorch policy: out of memory allocating {requested} bytes "
                f"(reserved {self.reserved}, allocated {self.allocated}, capacity {self.capacity})")
        return _Block(addr, alloc_size, stream, pool, addr)

    def free(self, addr):
        block = self._allocated.pop(addr)
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated:
                continue
            self._remove_free(neighbour)
            if neighbour is block.prev:
                block.addr, block.prev = neighbour.addr, neighbour.prev
                if neighbour.prev is not None:
                    neighbour.prev.next = block
            else:
                block.next = neighbour.next
                if neighbour.next is not None:
                    neighbour.next.prev = block
            block.size += neighbour.size
        self._insert_free(block)


class TorchExpandablePolicyModel(TorchPolicyModel):
    """PyTorch's caching allocator with ``expandable_segments:True`` (``ExpandableSegment``).

    The rules modeled, from ``CUDACachingAllocator.cpp``: each (stream, pool) has one segment, a
    virtual address range that physical pages are mapped into on demand, 2 MiB pages for the
    small pool and 20 MiB (``kLargeBuffer``) for the large one. Rounding and pools are those of
    :class:`TorchPolicyModel`; two rules differ there:

    * ``should_split``: with expandable segments every remainder of at least 512 bytes is split
      off, in the large pool too (the classic large pool keeps remainders up to 1 MiB attached);
    * ``get_free_block``: for best fit an expandable block counts as the size it can grow to (its
      own plus the unmapped block right after it): from the smallest block that fits, the search
      moves on while the next block of the stream can grow to less.

    A request no free block serves maps the pages it lacks (the rounded request, not the classic
    segment size) at the lowest-address unmapped block of its segment, counting the free block
    just before it. Free pages are unmapped only when the cache is released (``empty_cache``, or
    the device refusing pages: release, then retry once). ``num_device_alloc`` /
    ``num_device_free`` count map / unmap calls (``segment_map`` / ``segment_unmap``).
    """

    PAGE = {"small": SMALL_BUFFER, "large": LARGE_BUFFER}
    RANGE = 1 << 46  # address space per segment: never the limit in a replay

    def __init__(self, capacity=None):
        super().__init__(capacity=capacity)
        self._segments = {}  # (stream, pool) -> head block
        self.map_calls = []  # bytes of every map, in order

    def _should_split(self, pool, rounded, remaining):
        return remaining >= MIN_BLOCK_SIZE

    def _best_fit(self, keys, i, stream):
        def growable(block):
            after = block.next
            return block.size + (after.size if after is not None and not after.mapped else 0)

        while (i + 1 < len(keys) and keys[i + 1][0] == stream
               and growable(self._free_blocks[keys[i + 1]]) < growable(self._free_blocks[keys[i]])):
            i += 1
        return i

    def _new_segment(self, pool, stream, rounded, requested):
        head = self._segments.get((stream, pool))
        if head is None:
            addr = self._next_addr
            self._next_addr += self.RANGE
            head = _Block(addr, self.RANGE, stream, pool, addr, mapped=False)
            self._segments[(stream, pool)] = head
        block = self._grow(head, rounded)
        if block is None:
            self.num_alloc_retries += 1
            self._release_cached()
            block = self._grow(self._segments[(stream, pool)], rounded)
        if block is None:
            self.num_ooms += 1
            raise ModelOutOfMemory(
                f"modeled PyTorch expandable policy: out of memory allocating {requested} bytes "
                f"(reserved {self.reserved}, allocated {self.allocated}, capacity {self.capacity})")
        return block

    def _grow(self, head, rounded):
        page = self.PAGE[head.pool]
        gap = head
        while gap is not None and gap.mapped:
            gap = gap.next
        while gap is not None:  # the lowest-address unmapped block with room
            before = gap.prev if gap.prev is not None and gap.prev.mapped and not gap.prev.allocated else None
            have = before.size if before is not None else 0
            need = -(-(rounded - have) // page) * page
            if need <= gap.size:
                break
            gap = gap.next
            while gap is not None and gap.mapped:
                gap = gap.next
        if gap is None:
            return None
        if self.capacity is not None and self.reserved + need > self.capacity:
            return None
        self.reserved += need
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.num_device_alloc += 1
        self.map_calls.append(need)
        fresh = _Block(gap.addr, need, gap.stream, gap.pool, gap.segment_addr, mapped=True)
        self._link_before(fresh, gap)
        gap.addr += need
        gap.size -= need
        if gap.size == 0:
            self._unlink(gap)
        if before is not None:
            self._remove_free(before)
            before.size += fresh.size
            self._unlink(fresh)
            fresh = before
        return fresh

    def _link_before(self, block, anchor):
        block.prev, block.next = anchor.prev, anchor
        if anchor.prev is not None:
            anchor.prev.next = block
        elif self._segments.get((anchor.stream, anchor.pool)) is anchor:
            self._segments[(anchor.stream, anchor.pool)] = block
        anchor.prev = block

    def _unlink(self, block):
        if block.prev is not None:
            block.prev.next = block.next
        elif self._segments.get((block.stream, block.pool)) is block:
            self._segments[(block.stream, block.pool)] = block.next
        if block.next is not None:
            block.next.prev = block.prev

    def _release_cached(self, min_size=0):
        """Unmap the whole pages of every free block (PyTorch's release of expandable segments)."""
        for key in list(self._free_blocks):
            block = self._free_blocks[key]
            page, base = self.PAGE[block.pool], block.segment_addr  # pages count from the range's start
            lo = base + -(-(block.addr - base) // page) * page
            hi = base + (block.addr + block.size - base) // page * page
            if hi <= lo:
                continue
            self._remove_free(block)
            self.reserved -= hi - lo
            self.num_device_free += 1
            gap = _Block(lo, hi - lo, block.stream, block.pool, block.segment_addr, mapped=False)
            self._link_before(gap, block)
            tail = _Block(hi, block.addr + block.size - hi, block.stream, block.pool,
                                    block.segment_addr, mapped=True)
            self._link_before(tail, block)
            self._unlink(block)
            block.size = lo - block.addr
            if block.size:
                self._link_before(block, gap)
                self._insert_free(block)
            if tail.size:
                self._insert_free(tail)
            else:
                self._unlink(tail)
            for neighbour in (gap.prev, gap.next):  # coalesce unmapped neighbours
                if neighbour is not None and not neighbour.mapped:
                    lower, upper = (neighbour, gap) if neighbour is gap.prev else (gap, neighbour)
                    lower.size += upper.size
                    self._unlink(upper)
                    gap = lower

    def free(self, addr):
        block = self._allocated.pop(addr)
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated or not neighbour.mapped:
                continue
            self._remove_free(neighbour)
            if neighbour is block.prev:
                block.addr = neighbour.addr
            block.size += neighbour.size
            self._unlink(neighbour)
        self._insert_free(block)
