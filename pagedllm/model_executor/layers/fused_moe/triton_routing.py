"""The fused MoE's routing on CUDA in Triton: the router GEMM, softmax + top-k, and each expert's pairs listed
for the grouped GEMMs (`triton_moe.py`). CUDA only; the import is guarded.

The layout, `ExpertSlots`: `counts[e]`, the number of (token, k) pairs routed to expert e, and `slots[e * cap + r]`,
the id (token * k + slot) of e's r-th pair, for r < counts[e] (cap = T: top-k experts are distinct, so an expert
gets at most one pair per token). The pairs' order inside an expert is arbitrary: every pair's output row
depends on its own row only. The top-k kernel fills it: an atomic add per pair counts the pair for its expert,
and the old count is the pair's rank, where the pair is written. A grouped GEMM program finds its expert and rows
from the counts (`triton_moe._grouped_gemm_kernel`), so no prefix sum over the experts and no placement launch
are needed. Given the router's weight, the routing is two launches (`router_partials`, which also zeroes the
counts, and the top-k); given logits, a memset and the top-k; given the top-k (`expert_slots`), a memset and a
count launch. Output shapes depend on T only, so a decode batch captures in a CUDA graph.

Tried and dropped (session 29, H200):
- the whole routing in ONE program, to save the launches: 101 us a layer at 256 tokens against 11.5 for the
  launches (one SM doing the top-k and the ranks serially);
- a placement launch after the counts, writing the pairs in BLOCK_M-padded runs: ~4.4 us a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.triton_utils import HAS_TRITON, num_sms
from pagedllm.utils import next_pow2


@dataclass
class ExpertSlots:
    """Each expert's pairs (see the module docstring): `counts` [E] int32, `slots` [E * cap] int32."""

    counts: torch.Tensor
    slots: torch.Tensor
    cap: int

    @classmethod
    def empty(cls, num_experts: int, num_tokens: int, device: torch.device, zero_counts: bool) -> ExpertSlots:
        """Unwritten slots; the counts zeroed here (a memset) or left for the router kernel to zero."""
        make = torch.zeros if zero_counts else torch.empty
        counts = make(num_experts, dtype=torch.int32, device=device)
        slots = torch.empty(num_experts * num_tokens, dtype=torch.int32, device=device)
        return cls(counts, slots, num_tokens)


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

    @triton.jit(do_not_specialize=["cap"])
    def _topk_softmax_kernel(
        logits_ptr,
        weights_ptr,
        ids_ptr,
        counts_ptr,
        slots_ptr,
        cap,
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
        """One token's top-k; with COUNT, each pair also counted for its expert and written to the expert's slot of
        that rank (the old count). With
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
            tl.store(slots_ptr + top_i.to(tl.int64) * cap + rank, row * TOP_K + ko[None, :], mask=kmask)

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

    # The pair count and the capacity follow the batch: not specialized on, one variant for every batch.
    @triton.jit(do_not_specialize=["n", "cap"])
    def _count_experts_kernel(ids_ptr, counts_ptr, slots_ptr, n, cap, BLOCK: tl.constexpr):
        """Each pair counted for its expert e (an atomic add) and written to e's slot of that rank."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        e = tl.load(ids_ptr + offs, mask=mask, other=0)
        rank = tl.atomic_add(counts_ptr + e, 1, mask=mask)
        tl.store(slots_ptr + e.to(tl.int64) * cap + rank, offs, mask=mask)


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax + top-k (+ renormalization) in one launch: (weights [T, k] float32, ids [T, k] int32)."""
    return _topk(router_logits, top_k, renormalize, None)


def _topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    slots: ExpertSlots | None,
    parts: int = 0,
    logits_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids); where `slots` (zeroed counts) is given, every pair is also counted and written to it.
    `parts` > 0: `router_logits` is [parts, T, E] float32 partials to sum and round to `logits_dtype`."""
    t, e = router_logits.shape[-2:]
    device = router_logits.device
    weights = torch.empty((t, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=device)
    if t:
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
        _topk_softmax_kernel[(t,)](
            logits,
            weights,
            ids,
            ids if slots is None else slots.counts,
            ids if slots is None else slots.slots,
            0 if slots is None else slots.cap,
            logits.stride(-2),
            logits.stride(0) if parts else 0,
            e,
            TOP_K=top_k,
            BLOCK_E=next_pow2(e),
            BLOCK_K=next_pow2(top_k),
            RENORMALIZE=renormalize,
            COUNT=slots is not None,
            PARTS=parts,
            LOGITS_DTYPE=_TL_DTYPES[logits_dtype or router_logits.dtype],
            num_warps=1 if e <= 64 else 2,
        )
    return weights, ids


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


def expert_slots(topk_ids: torch.Tensor, num_experts: int) -> ExpertSlots:
    """Each expert's pairs for a given top-k [T, k] (a memset and one launch, no host sync, capturable)."""
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    n = flat.numel()
    slots = ExpertSlots.empty(num_experts, topk_ids.shape[0], flat.device, zero_counts=True)
    if n:
        _count_experts_kernel[(triton.cdiv(n, 256),)](flat, slots.counts, slots.slots, n, slots.cap, BLOCK=256)
    return slots


def route(
    router_logits: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    gate: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ExpertSlots]:
    """(weights [T, k] float32, ids [T, k] int32, each expert's pairs) for router logits [T, E] (T > 0), or with
    `gate` = (x [T, H], router weight [E, H]) instead of logits, the router GEMM run here too (`router_partials`,
    which also zeroes the counts)."""
    if gate is not None:
        x, weight = gate
        slots = ExpertSlots.empty(weight.shape[0], x.shape[0], x.device, zero_counts=False)
        part = router_partials(x, weight, slots.counts)
        weights, ids = _topk(part, top_k, renormalize, slots, parts=part.shape[0], logits_dtype=x.dtype)
    else:
        assert router_logits is not None
        t, e = router_logits.shape
        slots = ExpertSlots.empty(e, t, router_logits.device, zero_counts=True)
        weights, ids = _topk(router_logits, top_k, renormalize, slots)
    return weights, ids, slots
