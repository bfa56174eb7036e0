"""Maps requests to KV-cache blocks, one block list per layer group, over one shared BlockPool."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache_utils import KVCacheGroup
from pagedllm.core.request import Request
from pagedllm.utils import cdiv


class SingleTypeKVCacheManager:
    """Blocks of every request for one layer group. Full attention keeps every block."""

    def __init__(self, group: KVCacheGroup, pool: BlockPool) -> None:
        self.block_size = group.spec.block_size
        self.pool = pool
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        for h in block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future token can attend to (nothing, for full attention)."""

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed: list[KVCacheBlock]) -> int:
        have = len(self.req_blocks.get(request_id, ())) + len(new_computed)
        need = max(0, cdiv(num_tokens, self.block_size) - have)
        # Hits that sit in the free queue stop being allocatable once touched.
        return need + sum(1 for b in new_computed if b.ref_cnt == 0)

    def allocate(self, request_id: str, num_tokens: int, new_computed: list[KVCacheBlock]) -> list[KVCacheBlock]:
        blocks = self.req_blocks.setdefault(request_id, [])
        if new_computed:
            self.pool.touch(new_computed)
            blocks.extend(new_computed)
            self.num_cached_blocks[request_id] = len(blocks)
        need = cdiv(num_tokens, self.block_size) - len(blocks)
        new = self.pool.get_new_blocks(need) if need > 0 else []
        blocks.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the hashes of blocks that will be full once `num_tokens` are computed."""
        blocks = self.req_blocks[request.request_id]
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Frees blocks that fell out of the window (replacing them by the null block in the table).

    Prefix-cache hits are not used for sliding-window groups (a hit would need the window's blocks
    right before the hit point, which this manager does not track): they always compute.
    """

    def __init__(self, group: KVCacheGroup, pool: BlockPool) -> None:
        super().__init__(group, pool)
        assert group.spec.sliding_window is not None
        self.sliding_window = group.spec.sliding_window

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[KVCacheBlock]:
        return []

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Nothing to register: hits are never looked up for this group."""

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        # The next query token sits at position num_computed_tokens; it sees keys > pos - window.
        first_needed = max(0, num_computed_tokens - self.sliding_window + 1)
        last_skipped = first_needed // self.block_size - 1
        for i in range(last_skipped, -1, -1):
            if blocks[i] is self.pool.null_block:
                break
            self.pool.free_blocks([blocks[i]])
            blocks[i] = self.pool.null_block


@dataclass
class KVCacheBlocks:
    """Blocks per group (the scheduler's handle on an allocation)."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        blocks = self.blocks
        if len(blocks) == 1:  # one group (every decode reaching a block boundary): no generator
            return ([b.block_id for b in blocks[0]],)
        return tuple([b.block_id for b in g] for g in blocks)


class KVCacheManager:
    def __init__(
        self,
        groups: list[KVCacheGroup],
        num_blocks: int,
        max_model_len: int,
        enable_caching: bool,
    ) -> None:
        if not groups:
            raise ValueError("the model has no attention layers with a KV cache")
        self.groups = groups
        self.block_size = groups[0].spec.block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.managers: list[SingleTypeKVCacheManager] = [
            (SlidingWindowManager if g.spec.sliding_window is not None else SingleTypeKVCacheManager)(g, self.pool)
            for g in groups
        ]
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Decodes that stay inside their last block need no allocation and register no block hash:
        # with only full-attention groups (nothing to free, no window), allocate_slots can say so
        # from the first group's block list alone (all groups share the block size).
        self._fast_decode = all(type(m) is SingleTypeKVCacheManager for m in self.managers) and all(
            g.spec.block_size == self.block_size for g in groups
        )
        self.no_new_blocks = KVCacheBlocks(tuple([] for _ in self.managers))
        """Shared, read-only result of allocations that added no block."""

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

    def empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.managers))

    def get_computed_blocks(self, request: Request, use_cache: bool = True) -> tuple[KVCacheBlocks, int]:
        """Longest prefix-cache hit (whole blocks, common to all groups), leaving at least one token
        to compute so the step produces logits."""
        if not self.enable_caching or not use_cache:
            return self.empty_blocks(), 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        per_group = [m.find_longest_cache_hit(request.block_hashes, max_blocks) for m in self.managers]
        n = min(len(h) for h in per_group)
        hits = KVCacheBlocks(tuple(h[:n] for h in per_group))
        return hits, n * self.block_size

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and the hit ones).
        Returns the newly allocated blocks, or None (nothing changed) when the pool is too small."""
        if self._fast_decode and not num_new_computed_tokens and new_computed_blocks is None:
            if request.num_computed_tokens + num_new_tokens <= request.kv_fast_limit:
                return self.no_new_blocks
            m0 = self.managers[0]
            blocks = m0.req_blocks.get(request.request_id)
            if blocks is not None:
                total = request.num_computed_tokens + num_new_tokens
                # Room in the blocks held, and no block becomes full (hence cacheable) in this step.
                if total <= len(blocks) * self.block_size and (
                    not self.enable_caching
                    or min(total, request.num_tokens) // self.block_size
                    <= m0.num_cached_blocks.get(request.request_id, 0)
                ):
                    return self.no_new_blocks
                if len(self.managers) == 1:
                    return self._grow_single(request, blocks, total)
        computed = new_computed_blocks.blocks if new_computed_blocks else tuple([] for _ in self.managers)
        rid = request.request_id
        for m in self.managers:
            m.remove_skipped_blocks(rid, request.num_computed_tokens)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        need = sum(m.num_blocks_to_allocate(rid, total, c) for m, c in zip(self.managers, computed))
        if need > self.pool.num_free_blocks:
            return None
        new = tuple(m.allocate(rid, total, c) for m, c in zip(self.managers, computed))
        if self.enable_caching:
            cacheable = min(total, request.num_tokens)
            for m in self.managers:
                m.cache_blocks(request, cacheable)
        if self._fast_decode:
            self._set_fast_limit(request)
        return KVCacheBlocks(new)

    def _grow_single(self, request: Request, blocks: list[KVCacheBlock], total: int) -> KVCacheBlocks | None:
        """The general path below for one full-attention group and a request that already holds blocks,
        without hits (a decode reaching a block boundary): the same blocks taken and hashes registered,
        without the per-group loops."""
        need = -(-total // self.block_size) - len(blocks)
        new: list[KVCacheBlock] = []
        if need > 0:
            if need > self.pool.num_free_blocks:
                return None
            new = self.pool.get_new_blocks(need)
            blocks.extend(new)
        if self.enable_caching:
            self.managers[0].cache_blocks(request, min(total, request.num_tokens))
        self._set_fast_limit(request)
        return KVCacheBlocks((new,)) if new else self.no_new_blocks

    def _set_fast_limit(self, request: Request) -> None:
        """`request.kv_fast_limit`: the largest computed-token total that the blocks held cover without
        a block becoming full (a full block gets its hash registered). Up to it, allocate_slots for a
        decode changes nothing, so the scheduler skips the call. Conservative (totals above it just take
        the exact path); reset by `free`."""
        m0 = self.managers[0]
        rid = request.request_id
        limit = len(m0.req_blocks.get(rid, ())) * self.block_size
        if self.enable_caching:
            limit = min(limit, (m0.num_cached_blocks.get(rid, 0) + 1) * self.block_size - 1)
        request.kv_fast_limit = limit

    def free(self, request: Request) -> None:
        request.kv_fast_limit = 0
        for m in self.managers:
            m.free(request.request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(m.block_ids(request_id) for m in self.managers)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
