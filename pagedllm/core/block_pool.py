"""The pool of KV-cache blocks: reference counts, a free queue (blocks holding nothing first, cached ones
in LRU order) and the prefix-cache hash index.

Block 0 is the null block: never allocated, used as a placeholder in block tables (sliding-window
layers replace blocks that fell out of the window with it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: need at least 2 KV-cache blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed
        # Free blocks in reuse order: the first is taken (evicted) first. Freed blocks with a cached hash go to
        # the end (LRU); freed blocks without one hold nothing reusable and go to the front, so new requests
        # write memory already written (`free_blocks`).
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_cached_free = 0
        """Free blocks still holding a cached hash (reusable by a prefix hit until evicted); kept as a
        counter so the stats snapshot (`snapshot_counts`) is O(1)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_usage(self) -> float:
        """Fraction of usable blocks in use; cached blocks that are free count as free (as vLLM)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def snapshot_counts(self) -> tuple[int, int, int]:
        """(usable blocks, blocks in use, free blocks still cached), in O(1): the dashboard's KV grid."""
        usable = self.num_blocks - 1
        return usable, usable - len(self._free), self.num_cached_free

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise ValueError(f"cannot get {n} free blocks: only {len(self._free)} free")
        out = []
        popitem = self._free.popitem
        for _ in range(n):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                self.num_cached_free -= 1
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits (removing free ones from the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each; blocks reaching zero join the free queue: cached ones at the end in the
        given order (callers pass a request's blocks tail first, so its prefix survives eviction longest),
        uncached ones at the front. An uncached block has nothing to keep, and reusing it before a block never
        written saves a page fault: the CPU cache is calloc'ed, so a fresh engine's first write to each page
        faults (0.27 s of an 8,000-token prefill on a 2-vCPU VM, NOTES session 33)."""
        free = self._free
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block
                if block.block_hash is not None:
                    self.num_cached_free += 1
                else:
                    free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Registers a full block under its hash. If an identical block is already cached, the index
        keeps the existing one (this block then holds duplicate KV and is evicted normally)."""
        if block.block_hash is not None or not self.enable_caching:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            block.block_hash = block_hash
            if block.ref_cnt == 0:
                self.num_cached_free += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no request holds a block."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached.values():  # nothing to keep now: reused first, as `free_blocks` does
            block.block_hash = None
            self._free.move_to_end(block.block_id, last=False)
        self.cached.clear()
        self.num_cached_free = 0
        return True

    def check_invariants(self) -> None:
        """For tests: refcounts non-negative, free queue == blocks with ref 0, index consistent."""
        for b in self.blocks[1:]:
            assert b.ref_cnt >= 0, b
            assert (b.ref_cnt == 0) == (b.block_id in self._free), b
        for h, b in self.cached.items():
            assert b.block_hash == h, b
        assert self.num_cached_free == sum(1 for b in self._free.values() if b.block_hash is not None)
