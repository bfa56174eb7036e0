"""The fused MoE's routing on CUDA in Triton: softmax + top-k, and the (token, k) pairs sorted by expert in
BLOCK_M-aligned runs for the grouped GEMMs (`triton_moe.py`). CUDA only; the import is guarded.

`route_and_align` takes router logits to the sorted order in two launches and a memset: the top-k kernel
also counts each expert's pairs (an atomic add per pair, whose old value is the pair's rank among them), then
one placement kernel. `fused_topk` + `moe_align_block_size` are the same steps apart (top-k given by the caller),
with the count in a launch of its own.

Layout of the sorted order: the pair ids grouped by expert (in no particular order inside an expert: every
pair's output row depends on its own row only), each expert's run padded to a multiple of BLOCK_M with the
sentinel T*k; the expert of every BLOCK_M block; the padded total (the grouped GEMMs stop there). Output
shapes depend on T only, so a decode batch captures in a CUDA graph.

(Tried and dropped, session 29: the whole routing in ONE program, to save the launches. It costs 101 us a
layer at 256 tokens against 11.5 for the launches on an H200: one SM doing the top-k and the ranks serially.)
"""

from __future__ import annotations

import functools

import torch

from pagedllm import envs
from pagedllm.triton_utils import HAS_TRITON, num_sms
from pagedllm.utils import next_pow2


@functools.cache
def place_block() -> int:
    """Pairs per program of the placement kernel (PAGEDLLM_MOE_PLACE_BLOCK; 256 in the first measured version)."""
    return int(envs.PAGEDLLM_MOE_PLACE_BLOCK)


if HAS_TRITON:
    import triton
    import triton.language as tl

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

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
        counts_ptr,
        rank_ptr,
        stride_l,
        stride_part,
        num_experts,
        TOP_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        COUNT: tl.constexpr,
        PARTS: tl.constexpr,
        LOGITS_DTYPE: tl.constexpr,
    ):
        """One token's top-k; with COUNT, each pair also counted for its expert, the old count its rank. With
        PARTS > 0 the logits are the router GEMM's float32 split-K partials (`_router_kernel`, PARTS slices
        `stride_part` apart), summed in slice order and rounded to LOGITS_DTYPE, as the router's linear layer
        would have returned them."""
        row = tl.program_id(0)
        eo = tl.arange(0, BLOCK_E)
        emask = eo < num_experts
        ko = tl.arange(0, BLOCK_K)
        if PARTS > 0:
            x = tl.zeros([1, BLOCK_E], dtype=tl.float32)
            for p in tl.static_range(PARTS):
                x += tl.load(logits_ptr + p * stride_part + row * stride_l + eo[None, :], mask=emask[None, :])
            x = tl.where(emask[None, :], x.to(LOGITS_DTYPE).to(tl.float32), -float("inf"))
        else:
            x = tl.load(logits_ptr + row * stride_l + eo[None, :], mask=emask[None, :], other=-float("inf"))
        top_w, top_i = _softmax_topk(x.to(tl.float32), emask, eo, ko, TOP_K, BLOCK_E, RENORMALIZE)
        kmask = ko[None, :] < TOP_K
        tl.store(weights_ptr + row * TOP_K + ko[None, :], top_w, mask=kmask)
        tl.store(ids_ptr + row * TOP_K + ko[None, :], top_i, mask=kmask)
        if COUNT:
            rank = tl.atomic_add(counts_ptr + top_i, 1, mask=kmask)
            tl.store(rank_ptr + row * TOP_K + ko[None, :], rank, mask=kmask)

    @triton.jit(do_not_specialize=["n_tokens"])
    def _router_kernel(
        x_ptr,
        w_ptr,
        part_ptr,
        counts_ptr,
        n_tokens,
        num_experts,
        stride_x,
        stride_w,
        K: tl.constexpr,
        K_SPLIT: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Router logits x [T, K] @ w [E, K]^T as float32 partials: program (i, s) writes rows i * BLOCK_T.. of
        slice s (its K_SPLIT-wide part of K) to part[s]. Program (0, 0) also zeroes the per-expert counts that
        the top-k kernel then adds to (no memset launch)."""
        pid_t = tl.program_id(0)
        s = tl.program_id(1)
        rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < n_tokens
        eo = tl.arange(0, BLOCK_E)
        emask = eo < num_experts
        ko = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for k0 in tl.static_range(0, K_SPLIT, BLOCK_K):
            k = s * K_SPLIT + k0 + ko
            kmask = k < K
            a_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :]
            a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :])
            b = tl.load(w_ptr + eo[None, :] * stride_w + k[:, None], mask=emask[None, :] & kmask[:, None])
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        out = part_ptr + (s.to(tl.int64) * n_tokens + rows[:, None].to(tl.int64)) * num_experts + eo[None, :]
        tl.store(out, acc, mask=rmask[:, None] & emask[None, :])
        if (pid_t == 0) & (s == 0):
            tl.store(counts_ptr + eo, tl.zeros([BLOCK_E], dtype=tl.int32), mask=emask)

    # Pair and block counts follow the batch: not specialized on, one variant for every batch.
    @triton.jit(do_not_specialize=["n"])
    def _count_experts_kernel(ids_ptr, counts_ptr, rank_ptr, n, BLOCK: tl.constexpr):
        """counts[e] += 1 per pair routed to e; the pair's rank among them (order within an expert is
        arbitrary: every pair's output row depends on its own row only)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        e = tl.load(ids_ptr + offs, mask=mask, other=0)
        rank = tl.atomic_add(counts_ptr + e, 1, mask=mask)
        tl.store(rank_ptr + offs, rank, mask=mask)

    @triton.jit(do_not_specialize=["n", "num_blocks"])
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
        ends = tl.cumsum(padded, axis=0)
        blk = pid * BLOCK + tl.arange(0, BLOCK)
        owner = tl.sum(((ends[None, :] <= blk[:, None] * BLOCK_M) & emask[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, tl.minimum(owner, num_experts - 1), mask=blk < num_blocks)
        if pid == 0:
            tl.store(npp_ptr, tl.sum(padded, axis=0))
            po = tl.arange(0, BLOCK_M)
            pad = emask[:, None] & (po[None, :] < (padded - counts)[:, None])
            tl.store(sorted_ptr + (ends - padded + counts)[:, None] + po[None, :], n, mask=pad)


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax + top-k (+ renormalization) in one launch: (weights [T, k] float32, ids [T, k] int32)."""
    weights, ids, _ = _topk(router_logits, top_k, renormalize, None)
    return weights, ids


def _topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor | None,
    parts: int = 0,
    logits_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weights, ids, each pair's rank in its expert where `counts` (zeroed, [E] int32) is given: counted).
    `parts` > 0: `router_logits` is [parts, T, E] float32 partials to sum and round to `logits_dtype`."""
    t, e = router_logits.shape[-2:]
    device = router_logits.device
    weights = torch.empty((t, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=device)
    rank = None if counts is None else torch.empty(t * top_k, dtype=torch.int32, device=device)
    if t:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        _topk_softmax_kernel[(t,)](
            logits,
            weights,
            ids,
            ids if counts is None else counts,
            ids if rank is None else rank,
            logits.stride(-2),
            logits.stride(0) if parts else 0,
            e,
            TOP_K=top_k,
            BLOCK_E=next_pow2(e),
            BLOCK_K=next_pow2(top_k),
            RENORMALIZE=renormalize,
            COUNT=counts is not None,
            PARTS=parts,
            LOGITS_DTYPE=_TL_DTYPES[logits_dtype or router_logits.dtype],
            num_warps=1 if e <= 64 else 2,
        )
    return weights, ids, rank


def router_tiles(t: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_K, K_SPLIT) of `router_partials` for T tokens of width K: K cut into a power of two of
    splits (at most 8) for ~2 programs per SM. Few compiled variants, each reached by a power-of-two batch, so
    that `triton_moe.warm_up` compiles them all (a split of 3 at 5,000 tokens compiled inside W6's run)."""
    block_t = 16 if t <= 64 else 64
    block_k = 128 if k >= 128 else max(16, next_pow2(k))
    room = max(1, min(8, -(-k // block_k), (2 * sms) // -(-t // block_t)))
    splits = 1 << (room.bit_length() - 1)
    per_split = -(-k // splits)
    return block_t, block_k, -(-per_split // block_k) * block_k


def router_partials(x: torch.Tensor, gate_weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [T, H] @ gate_weight [E, H]^T as [S, T, E] float32 split-K partials (one launch; S by T: ~2 programs per
    SM at decode sizes, 1 for prefill-sized batches), zeroing `counts` [E] int32 on the way."""
    t, k = x.shape
    e = gate_weight.shape[0]
    block_t, block_k, k_split = router_tiles(t, k, num_sms(x.device) if x.is_cuda else 16)
    t_blocks = triton.cdiv(t, block_t)
    splits = triton.cdiv(k, k_split)
    part = torch.empty((splits, t, e), dtype=torch.float32, device=x.device)
    _router_kernel[(t_blocks, splits)](
        x,
        gate_weight,
        part,
        counts,
        t,
        e,
        x.stride(0),
        gate_weight.stride(0),
        K=k,
        K_SPLIT=k_split,
        BLOCK_T=block_t,
        BLOCK_E=max(16, next_pow2(e)),
        BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32,
        num_warps=4,
    )
    return part


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
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    rank = torch.empty(n, dtype=torch.int32, device=flat.device)
    _count_experts_kernel[(triton.cdiv(n, 256),)](flat, counts, rank, n, BLOCK=256)
    return _place(flat, counts, rank, block_m)


def _place(
    flat_ids: torch.Tensor, counts: torch.Tensor, rank: torch.Tensor, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The placement launch: pairs to their slots, blocks labelled, padding and the padded total written."""
    n, num_experts, device = flat_ids.numel(), counts.numel(), flat_ids.device
    max_padded = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m  # every expert's run padded
    num_blocks = max_padded // block_m
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    block = place_block()  # small: each program does [block x E] comparisons, many programs in parallel
    grid = (max(triton.cdiv(n, block), triton.cdiv(num_blocks, block)),)
    _place_pairs_kernel[grid](
        flat_ids,
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
    router_logits: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    block_m: int,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int32, sorted pair ids, the blocks' experts, the padded total) for
    router logits [T, E] (T > 0): `fused_topk` + `moe_align_block_size`'s results with the count in the top-k
    launch. With `gate` = (x [T, H], router weight [E, H]) instead of
    logits, the router GEMM runs here too (`router_partials`, which also zeroes the counts)."""
    if gate is not None:
        x, weight = gate
        counts = torch.empty(weight.shape[0], dtype=torch.int32, device=x.device)
        part = router_partials(x, weight, counts)
        weights, ids, rank = _topk(part, top_k, renormalize, counts, parts=part.shape[0], logits_dtype=x.dtype)
    else:
        assert router_logits is not None
        counts = torch.zeros(router_logits.shape[1], dtype=torch.int32, device=router_logits.device)
        weights, ids, rank = _topk(router_logits, top_k, renormalize, counts)
    assert rank is not None
    return (weights, ids, *_place(ids.view(-1), counts, rank, block_m))
