"""Fused MoE on CUDA in Triton: routing, token sort, two grouped GEMMs (CUDA only; import guarded).

`fused_experts` runs, with no host synchronisation and no Python loop over experts (so a decode batch
can be captured in a CUDA graph):

1. `moe_align_block_size`: the (token, k) pairs grouped by expert (an atomic count per expert, then
   every pair placed at its expert's offset + its rank), each expert's run padded to a multiple of
   BLOCK_M with a sentinel id, and the expert of every BLOCK_M block (fixed-size outputs sized for the
   worst case; `num_tokens_post_padded` tells the kernel where the real blocks end);
2. grouped GEMM `x @ w13[e].T` for every block (rows gathered from x by token id), with
3. SiLU-and-mul in its epilogue (each program computes matching gate and up columns);
4. grouped GEMM `act @ w2[e].T` times the routing weight, written per (token, k) pair;
5. the sum over the k experts of each token (one launch reading each token's k rows once, float32 sums in
   expert-slot order: cheaper than torch's generic reduction, ~7 us per layer at 256 tokens on the H200).

Float32 inputs multiply in IEEE float32 (`input_precision="ieee"`), 16-bit inputs accumulate in float32.
Kernel tile sizes come from `configs.get_config` (a table tuned for the W6 shapes on H100/H200).
"""

from __future__ import annotations

import functools

import torch

from pagedllm import envs
from pagedllm.model_executor.layers import triton_ops
from pagedllm.model_executor.layers.fused_moe.configs import get_config
from pagedllm.triton_utils import HAS_TRITON
from pagedllm.utils import next_pow2


@functools.cache
def fused_silu() -> bool:
    """SiLU-and-mul in the up GEMM's epilogue (PAGEDLLM_MOE_FUSED_SILU=0: a separate kernel, as measured first)."""
    return bool(envs.PAGEDLLM_MOE_FUSED_SILU)


@functools.cache
def place_block() -> int:
    """Pairs per program of the placement kernel (PAGEDLLM_MOE_PLACE_BLOCK; 256 in the first measured version)."""
    return int(envs.PAGEDLLM_MOE_PLACE_BLOCK)


if HAS_TRITON:
    import triton
    import triton.language as tl

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
        offs = tl.arange(0, BLOCK_E)
        mask = offs < num_experts
        x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = tl.where(mask, p, 0.0)
        p = p / tl.sum(p, axis=0)
        koffs = tl.arange(0, BLOCK_K)
        top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
        top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
        for i in tl.static_range(TOP_K):
            best = tl.max(p, axis=0)
            # Ties go to the lowest expert id, as torch.topk's do.
            idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
            top_w = tl.where(koffs == i, best, top_w)
            top_i = tl.where(koffs == i, idx, top_i)
            p = tl.where(offs == idx, -1.0, p)
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=0)
        kmask = koffs < TOP_K
        tl.store(weights_ptr + row * TOP_K + koffs, top_w, mask=kmask)
        tl.store(ids_ptr + row * TOP_K + koffs, top_i, mask=kmask)

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
        ends = tl.cumsum(padded, axis=0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        pmask = offs < n
        e = tl.load(ids_ptr + offs, mask=pmask, other=0)
        rank = tl.load(rank_ptr + offs, mask=pmask, other=0)
        start_of_e = tl.sum(tl.where(eo[None, :] < e[:, None], padded[None, :], 0), axis=1)
        tl.store(sorted_ptr + start_of_e + rank, offs, mask=pmask)
        blk = pid * BLOCK + tl.arange(0, BLOCK)
        owner = tl.sum(((ends[None, :] <= blk[:, None] * BLOCK_M) & emask[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, tl.minimum(owner, num_experts - 1), mask=blk < num_blocks)
        if pid == 0:
            tl.store(npp_ptr, tl.sum(padded, axis=0))
            po = tl.arange(0, BLOCK_M)
            pad = emask[:, None] & (po[None, :] < (padded - counts)[:, None])
            tl.store(sorted_ptr + (ends - padded + counts)[:, None] + po[None, :], n, mask=pad)

    @triton.jit
    def _grouped_gemm_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        topk_weights_ptr,
        sorted_token_ids_ptr,
        expert_ids_ptr,
        num_tokens_post_padded_ptr,
        N,
        K: tl.constexpr,
        EM,
        num_valid_tokens,
        stride_am,
        stride_ak,
        stride_be,
        stride_bn,
        stride_bk,
        stride_cm,
        stride_cn,
        A_ROW_DIV: tl.constexpr,
        MUL_ROUTED_WEIGHT: tl.constexpr,
        FUSE_SILU: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """C[pair] = A[pair // A_ROW_DIV] @ B[expert(pair)].T (times the pair's routing weight), for the
        pairs of each BLOCK_M block of the expert-sorted order; sentinel ids (>= num_valid_tokens) are
        padding and are neither read nor written. K is a compile-time constant (one of the model's two
        widths), which also keeps the K loop runnable under the Triton interpreter."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(EM, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_pid_n
        first_m = (pid // group) * GROUP_M
        group_size = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((pid % group) % group_size)
        pid_n = (pid % group) // group_size
        if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
            return
        offs_tok = tl.load(sorted_token_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        tok_mask = offs_tok < num_valid_tokens
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = (offs_tok // A_ROW_DIV).to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_left = K - k0
            a = tl.load(a_ptrs, mask=tok_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
            if FUSE_SILU:  # the up rows sit N rows below the gate rows of the same expert
                b_up = tl.load(b_ptrs + N * stride_bn, mask=offs_k[:, None] < k_left, other=0.0)
                if IEEE:
                    acc_up += tl.dot(a, b_up, input_precision="ieee")
                else:
                    acc_up += tl.dot(a, b_up)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if FUSE_SILU:
            # Rounded as the unfused path rounds: gate and up to the activation dtype, silu(gate) too.
            g = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
            u = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(c_ptr.dtype.element_ty).to(tl.float32)
            acc = act * u
        if MUL_ROUTED_WEIGHT:
            w = tl.load(topk_weights_ptr + offs_tok, mask=tok_mask, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + offs_tok.to(tl.int64)[:, None] * stride_cm + offs_cn[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=tok_mask[:, None] & (offs_cn[None, :] < N))

    @triton.jit
    def _moe_sum_kernel(x_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[t] = sum over k of x[t, k] ([T, k, H] -> [T, H]), accumulated in float32."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < hidden
        base = x_ptr + t * TOP_K * hidden + offs
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            acc += tl.load(base + k * hidden, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(x: torch.Tensor) -> torch.Tensor:
    """[T, k, H] (contiguous) -> [T, H]: each token's k expert outputs summed (float32 accumulation)."""
    t, top_k, hidden = x.shape
    out = torch.empty((t, hidden), dtype=x.dtype, device=x.device)
    if t:
        block = min(1024, next_pow2(hidden))
        _moe_sum_kernel[(t, triton.cdiv(hidden, block))](x, out, hidden, TOP_K=top_k, BLOCK_H=block, num_warps=4)
    return out


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
    max_padded = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    num_blocks = max_padded // block_m
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


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor,
    a_row_div: int,
    config: dict[str, int],
    fuse_silu: bool = False,
) -> None:
    """c[pair] = a[pair // a_row_div] @ b[e].T (x the routing weight if given); with `fuse_silu`, b holds
    gate rows then up rows and c = silu(gate) * up, half b's rows wide."""
    em = sorted_ids.numel()
    n, k = b.shape[1] // (2 if fuse_silu else 1), b.shape[2]
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    grid = (triton.cdiv(em, bm) * triton.cdiv(n, bn),)
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        topk_weights if topk_weights is not None else c,
        sorted_ids,
        expert_ids,
        num_post_padded,
        n,
        k,
        em,
        c.shape[0],
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        A_ROW_DIV=a_row_div,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        FUSE_SILU=fuse_silu,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=config["BLOCK_K"],
        GROUP_M=config["GROUP_M"],
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    configs: tuple[dict[str, int], dict[str, int]] | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_* [T, k] -> [T, H] in x's dtype. `configs` (the
    up and down GEMMs' tiles, same BLOCK_M) overrides the tuned table (used by the tuning script)."""
    t, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if t == 0:
        return torch.zeros_like(x)
    up_cfg, down_cfg = configs or get_config(num_experts, two_inter // 2, hidden, t, top_k)
    assert up_cfg["BLOCK_M"] == down_cfg["BLOCK_M"], "both GEMMs walk the same BLOCK_M-aligned order"
    x = x if x.stride(-1) == 1 else x.contiguous()
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, up_cfg["BLOCK_M"], num_experts)
    if fused_silu():
        act = torch.empty((t * top_k, two_inter // 2), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, act, None, sorted_ids, expert_ids, num_post, top_k, up_cfg, fuse_silu=True)
    else:
        inter = torch.empty((t * top_k, two_inter), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, inter, None, sorted_ids, expert_ids, num_post, top_k, up_cfg)
        act = triton_ops.silu_and_mul(inter)
    out = torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, out, topk_weights.reshape(-1), sorted_ids, expert_ids, num_post, 1, down_cfg)
    return moe_sum(out.view(t, top_k, hidden))
