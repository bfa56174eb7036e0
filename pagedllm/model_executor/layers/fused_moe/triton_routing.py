"""The fused MoE's routing on CUDA in Triton: softmax + top-k, and the (token, k) pairs sorted by expert in
BLOCK_M-aligned runs for the grouped GEMMs (`triton_moe.py`). CUDA only; the import is guarded.

Two ways, same layout:

* `route_and_align` (decode-sized batches, up to `ONE_PROGRAM_MAX_PAIRS` pairs): ONE program does the
  softmax, the top-k, each pair's rank among its expert's pairs, the placement, the blocks' experts and the
  padding. It replaces four launches and a memset (top-k, zeroed counts, atomic count, placement) whose
  kernels are a few microseconds each at W6's decode sizes, so that the launches and the gaps between them
  were most of the routing's time. Ranks follow pair order, so the sorted order is deterministic.
* `fused_topk` then `moe_align_block_size` (prefill-sized batches): many programs, atomics for the counts.

Layout of the sorted order (both ways): the pair ids grouped by expert, each expert's run padded to a
multiple of BLOCK_M with the sentinel T*k; the expert of every BLOCK_M block; the padded total (the grouped
GEMMs stop there). Output shapes depend on T only, so a decode batch captures in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch

from pagedllm import envs
from pagedllm.triton_utils import HAS_TRITON
from pagedllm.utils import next_pow2

ONE_PROGRAM_MAX_PAIRS = 4096
"""Batches of up to this many (token, k) pairs are routed by one program (W6: up to 512 tokens)."""


@functools.cache
def place_block() -> int:
    """Pairs per program of the placement kernel (PAGEDLLM_MOE_PLACE_BLOCK; 256 in the first measured version)."""
    return int(envs.PAGEDLLM_MOE_PLACE_BLOCK)


@functools.cache
def one_program_routing() -> bool:
    """`route_and_align` for decode-sized batches (PAGEDLLM_MOE_ONE_PROGRAM_ROUTE=0: the multi-launch way)."""
    return bool(envs.PAGEDLLM_MOE_ONE_PROGRAM_ROUTE)


def padded_sizes(num_pairs: int, block_m: int, num_experts: int) -> tuple[int, int]:
    """(slots of the sorted order, BLOCK_M blocks) in the worst case: every expert's run padded."""
    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    return max_padded, max_padded // block_m


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _softmax_topk(x, emask, eo, ko, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr):
        """Rows of logits [R, BLOCK_E] (float32, -inf past the experts) -> (weights [R, BLOCK_K], ids)."""
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = tl.where(emask[None, :], p, 0.0)
        p = p / tl.sum(p, axis=1)[:, None]
        top_w = tl.zeros([x.shape[0], ko.shape[0]], dtype=tl.float32)
        top_i = tl.zeros([x.shape[0], ko.shape[0]], dtype=tl.int32)
        for i in tl.static_range(TOP_K):
            best = tl.max(p, axis=1)
            # Ties go to the lowest expert id, as torch.topk's do.
            idx = tl.min(tl.where(p == best[:, None], eo[None, :], BLOCK_E), axis=1)
            top_w = tl.where(ko[None, :] == i, best[:, None], top_w)
            top_i = tl.where(ko[None, :] == i, idx[:, None], top_i)
            p = tl.where(eo[None, :] == idx[:, None], -1.0, p)
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=1)[:, None]
        return top_w, top_i

    @triton.jit
    def _topk_softmax_kernel(
        logits_ptr,
        weights_ptr,
        ids_ptr,
        stride_l,
        num_experts,
        TOP_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        RENORMALIZE: tl.constexpr,
    ):
        row = tl.program_id(0)
        eo = tl.arange(0, BLOCK_E)
        emask = eo < num_experts
        ko = tl.arange(0, BLOCK_K)
        x = tl.load(logits_ptr + row * stride_l + eo[None, :], mask=emask[None, :], other=-float("inf"))
        top_w, top_i = _softmax_topk(x.to(tl.float32), emask, eo, ko, TOP_K, BLOCK_E, RENORMALIZE)
        kmask = ko[None, :] < TOP_K
        tl.store(weights_ptr + row * TOP_K + ko[None, :], top_w, mask=kmask)
        tl.store(ids_ptr + row * TOP_K + ko[None, :], top_i, mask=kmask)

    @triton.jit
    def _count_experts_kernel(ids_ptr, counts_ptr, rank_ptr, n, BLOCK: tl.constexpr):
        """counts[e] += 1 per pair routed to e; the pair's rank among them (order within an expert is
        arbitrary: every pair's output row depends on its own row only)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        e = tl.load(ids_ptr + offs, mask=mask, other=0)
        rank = tl.atomic_add(counts_ptr + e, 1, mask=mask)
        tl.store(rank_ptr + offs, rank, mask=mask)

    @triton.jit
    def _label_blocks(
        counts,
        emask,
        pid,
        expert_ids_ptr,
        sorted_ptr,
        npp_ptr,
        n,
        num_experts,
        num_blocks,
        write_padding,
        BLOCK_M: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Labels blocks [pid * BLOCK, (pid + 1) * BLOCK) with their expert; where `write_padding`, also writes
        the sentinel n into every expert's padding and the padded total."""
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        blk = pid * BLOCK + tl.arange(0, BLOCK)
        owner = tl.sum(((ends[None, :] <= blk[:, None] * BLOCK_M) & emask[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, tl.minimum(owner, num_experts - 1), mask=blk < num_blocks)
        if write_padding:
            tl.store(npp_ptr, tl.sum(padded, axis=0))
            po = tl.arange(0, BLOCK_M)
            pad = emask[:, None] & (po[None, :] < (padded - counts)[:, None])
            tl.store(sorted_ptr + (ends - padded + counts)[:, None] + po[None, :], n, mask=pad)

    @triton.jit
    def _place_pairs_kernel(
        ids_ptr,
        counts_ptr,
        rank_ptr,
        sorted_ptr,
        expert_ids_ptr,
        npp_ptr,
        n,
        num_experts,
        num_blocks,
        BLOCK_M: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        """Every program recomputes the experts' padded offsets from the counts (E is small) and places
        its BLOCK pairs at offset[e] + rank, and labels its BLOCK blocks with their expert; program 0
        also writes the sentinel n into each expert's padding and the padded total."""
        pid = tl.program_id(0)
        eo = tl.arange(0, BLOCK_E)
        emask = eo < num_experts
        counts = tl.load(counts_ptr + eo, mask=emask, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        pmask = offs < n
        e = tl.load(ids_ptr + offs, mask=pmask, other=0)
        rank = tl.load(rank_ptr + offs, mask=pmask, other=0)
        start_of_e = tl.sum(tl.where(eo[None, :] < e[:, None], padded[None, :], 0), axis=1)
        tl.store(sorted_ptr + start_of_e + rank, offs, mask=pmask)
        _label_blocks(
            counts,
            emask,
            pid,
            expert_ids_ptr,
            sorted_ptr,
            npp_ptr,
            n,
            num_experts,
            num_blocks,
            pid == 0,
            BLOCK_M,
            BLOCK,
        )

    @triton.jit
    def _route_align_kernel(
        logits_ptr,
        weights_ptr,
        ids_ptr,
        rank_ptr,
        sorted_ptr,
        expert_ids_ptr,
        npp_ptr,
        n_tokens,
        stride_l,
        num_experts,
        num_blocks,
        TOP_K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        ROWS: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_B: tl.constexpr,
        RENORMALIZE: tl.constexpr,
    ):
        """One program: ROWS tokens at a time, the top-k and each pair's rank among the earlier pairs of its
        expert (stored), the counts carried in registers; then every pair placed at its expert's padded
        start + rank, and the blocks labelled."""
        eo = tl.arange(0, BLOCK_E)
        emask = eo < num_experts
        ko = tl.arange(0, BLOCK_K)
        ro = tl.arange(0, ROWS)
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for r0 in range(0, n_tokens, ROWS):
            rows = r0 + ro
            rmask = rows < n_tokens
            x = tl.load(
                logits_ptr + rows[:, None] * stride_l + eo[None, :],
                mask=rmask[:, None] & emask[None, :],
                other=-float("inf"),
            ).to(tl.float32)
            x = tl.where(rmask[:, None] | ~emask[None, :], x, 0.0)  # rows past the batch: finite, unused
            top_w, top_i = _softmax_topk(x, emask, eo, ko, TOP_K, BLOCK_E, RENORMALIZE)
            pair = rows[:, None] * TOP_K + ko[None, :]
            pmask = rmask[:, None] & (ko[None, :] < TOP_K)
            tl.store(weights_ptr + pair, top_w, mask=pmask)
            tl.store(ids_ptr + pair, top_i, mask=pmask)
            # Pairs in pair order; a pair's rank = its expert's count so far + the earlier hits in this chunk.
            e = tl.reshape(tl.where(pmask, top_i, BLOCK_E), [ROWS * BLOCK_K])
            hit = (e[:, None] == eo[None, :]).to(tl.int32)
            before = tl.cumsum(hit, axis=0) - hit + counts[None, :]
            rank = tl.sum(hit * before, axis=1)
            tl.store(rank_ptr + tl.reshape(pair, [ROWS * BLOCK_K]), rank, mask=tl.reshape(pmask, [ROWS * BLOCK_K]))
            counts += tl.sum(hit, axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        starts = tl.cumsum(padded, axis=0) - padded
        tl.debug_barrier()  # the ids and ranks stored above are read back by other threads of the program
        n = n_tokens * TOP_K
        for p0 in range(0, n, CHUNK):
            offs = p0 + tl.arange(0, CHUNK)
            pm = offs < n
            e = tl.load(ids_ptr + offs, mask=pm, other=0)
            rank = tl.load(rank_ptr + offs, mask=pm, other=0)
            start_of_e = tl.sum(tl.where(eo[None, :] == e[:, None], starts[None, :], 0), axis=1)
            tl.store(sorted_ptr + start_of_e + rank, offs, mask=pm)
        for b0 in range(0, num_blocks, BLOCK_B):
            _label_blocks(
                counts,
                emask,
                b0 // BLOCK_B,
                expert_ids_ptr,
                sorted_ptr,
                npp_ptr,
                n,
                num_experts,
                num_blocks,
                b0 == 0,
                BLOCK_M,
                BLOCK_B,
            )


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax + top-k (+ renormalization) in one launch: (weights [T, k] float32, ids [T, k] int32)."""
    t, e = router_logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        _topk_softmax_kernel[(t,)](
            logits,
            weights,
            ids,
            logits.stride(0),
            e,
            TOP_K=top_k,
            BLOCK_E=next_pow2(e),
            BLOCK_K=next_pow2(top_k),
            RENORMALIZE=renormalize,
            num_warps=1 if e <= 64 else 2,
        )
    return weights, ids


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair ids grouped by expert [max_padded] int32, each expert's run padded to a multiple of
    BLOCK_M with the sentinel T*k; the expert of every BLOCK_M block [max_padded / BLOCK_M] int32; the
    number of real padded slots [1] int32). Two launches and a memset, no host sync, shapes fixed by T
    (capturable); slots past the padded total are left unwritten (the GEMMs stop before them)."""
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    n = flat.numel()
    device = flat.device
    max_padded, num_blocks = padded_sizes(n, block_m, num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(n, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    _count_experts_kernel[(triton.cdiv(n, 256),)](flat, counts, rank, n, BLOCK=256)
    block = place_block()  # small: each program does [block x E] comparisons, many programs in parallel
    grid = (max(triton.cdiv(n, block), triton.cdiv(num_blocks, block)),)
    _place_pairs_kernel[grid](
        flat,
        counts,
        rank,
        sorted_ids,
        expert_ids,
        num_post,
        n,
        num_experts,
        num_blocks,
        BLOCK_M=block_m,
        BLOCK=block,
        BLOCK_E=next_pow2(num_experts),
        num_warps=4,
    )
    return sorted_ids, expert_ids, num_post


def route_and_align(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int, num_warps: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int32, sorted pair ids, the blocks' experts, the padded total) for
    router logits [T, E]: `fused_topk` + `moe_align_block_size`'s results, in one launch while T * k is at most
    `ONE_PROGRAM_MAX_PAIRS` (and `one_program_routing()`), else those two. (`num_warps`: the one program's,
    for `benchmarks/moe_route_micro.py`.)"""
    t, num_experts = router_logits.shape
    n = t * top_k
    if n == 0 or n > ONE_PROGRAM_MAX_PAIRS or not one_program_routing():
        weights, ids = fused_topk(router_logits, top_k, renormalize)
        return (weights, ids, *moe_align_block_size(ids, block_m, num_experts))
    device = router_logits.device
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    max_padded, num_blocks = padded_sizes(n, block_m, num_experts)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=device)
    rank = torch.empty(n, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    block_k = next_pow2(top_k)
    rows = max(1, min(next_pow2(t), 128 // block_k))  # a chunk of ROWS * BLOCK_K pairs per pass
    _route_align_kernel[(1,)](
        logits,
        weights,
        ids,
        rank,
        sorted_ids,
        expert_ids,
        num_post,
        t,
        logits.stride(0),
        num_experts,
        num_blocks,
        TOP_K=top_k,
        BLOCK_K=block_k,
        BLOCK_E=next_pow2(num_experts),
        ROWS=rows,
        CHUNK=128,
        BLOCK_M=block_m,
        BLOCK_B=64,
        RENORMALIZE=renormalize,
        num_warps=num_warps,
    )
    return weights, ids, sorted_ids, expert_ids, num_post
