"""Fused MoE on CUDA in Triton: two grouped GEMMs and the sum over k (CUDA only; import guarded).

`fused_moe` (router logits in) and `fused_experts` (top-k given) run, with no host synchronisation and no
Python loop over experts (so a decode batch can be captured in a CUDA graph):

1. routing and the expert-sorted, BLOCK_M-aligned order of the (token, k) pairs (`triton_routing.py`);
2. grouped GEMM `x @ w13[e].T` for every block (rows gathered from x by token id), with
3. SiLU-and-mul in its epilogue (each program computes matching gate and up columns);
4. grouped GEMM `act @ w2[e].T` times the routing weight, written per (token, k) pair;
5. the sum over the k experts of each token (one launch reading each token's k rows once, float32 sums in
   expert-slot order: cheaper than torch's generic reduction, ~7 us per layer at 256 tokens on the H200),
   or, with `sum_experts=False`, left to the consumer (the next residual add + RMSNorm sums in its pass).

Float32 inputs multiply in IEEE float32 (`input_precision="ieee"`), 16-bit inputs accumulate in float32.
Kernel tile sizes come from `configs.get_config` (a table tuned for the W6 shapes on H100/H200).
"""

from __future__ import annotations

import functools

import torch

from pagedllm import envs
from pagedllm.model_executor.layers import triton_ops
from pagedllm.model_executor.layers.fused_moe.configs import get_config
from pagedllm.model_executor.layers.fused_moe.triton_routing import moe_align_block_size, route_and_align, router_tiles
from pagedllm.triton_utils import HAS_TRITON, num_sms
from pagedllm.utils import next_pow2


@functools.cache
def fused_silu() -> bool:
    """SiLU-and-mul in the up GEMM's epilogue (PAGEDLLM_MOE_FUSED_SILU=0: a separate kernel, as measured first)."""
    return bool(envs.PAGEDLLM_MOE_FUSED_SILU)


if HAS_TRITON:
    import triton
    import triton.language as tl

    # EM and num_valid_tokens follow the batch's token count: not specialized on ("divisible by 16"), so that one
    # compiled variant per tile configuration serves every batch (`warm_up` compiles them all at start-up).
    @triton.jit(do_not_specialize=["EM", "num_valid_tokens"])
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
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    up_cfg, down_cfg = configs or _configs(x, w13, topk_ids.shape[1])
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, up_cfg["BLOCK_M"], w13.shape[0])
    out = _expert_mlps(x, w13, w2, topk_weights, sorted_ids, expert_ids, num_post, (up_cfg, down_cfg))
    return moe_sum(out)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    sum_experts: bool = True,
    gate_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routing (`triton_routing.route_and_align`) and the experts for x [T, H] and router logits [T, E] (or,
    with `gate_weight` [E, H] and no logits, the router GEMM done here too): [T, H], or with
    `sum_experts=False` each token's k weighted expert outputs [T, k, H] unsummed (for a consumer that sums them
    in its own pass: `RMSNorm` with a residual does)."""
    t = x.shape[0]
    if t == 0:
        return torch.zeros_like(x) if sum_experts else x.new_zeros((0, top_k, x.shape[1]))
    cfgs = _configs(x, w13, top_k)
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate = None if gate_weight is None else (x, gate_weight)
    weights, _, sorted_ids, expert_ids, num_post = route_and_align(
        router_logits, top_k, renormalize, cfgs[0]["BLOCK_M"], gate
    )
    out = _expert_mlps(x, w13, w2, weights, sorted_ids, expert_ids, num_post, cfgs)
    return moe_sum(out) if sum_experts else out


def _configs(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> tuple[dict[str, int], dict[str, int]]:
    up_cfg, down_cfg = get_config(w13.shape[0], w13.shape[1] // 2, x.shape[1], x.shape[0], top_k)
    assert up_cfg["BLOCK_M"] == down_cfg["BLOCK_M"], "both GEMMs walk the same BLOCK_M-aligned order"
    return up_cfg, down_cfg


def _expert_mlps(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_post: torch.Tensor,
    configs: tuple[dict[str, int], dict[str, int]],
) -> torch.Tensor:
    """The two grouped GEMMs over the expert-sorted pairs: [T, k, H], each pair's output times its weight."""
    t, hidden = x.shape
    two_inter = w13.shape[1]
    top_k = topk_weights.shape[1]
    up_cfg, down_cfg = configs
    x = x if x.stride(-1) == 1 else x.contiguous()
    if fused_silu():
        act = torch.empty((t * top_k, two_inter // 2), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, act, None, sorted_ids, expert_ids, num_post, top_k, up_cfg, fuse_silu=True)
    else:
        inter = torch.empty((t * top_k, two_inter), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, inter, None, sorted_ids, expert_ids, num_post, top_k, up_cfg)
        act = triton_ops.silu_and_mul(inter)
    out = torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, out, topk_weights.reshape(-1), sorted_ids, expert_ids, num_post, 1, down_cfg)
    return out.view(t, top_k, hidden)


_WARMED: set[tuple] = set()


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool, max_num_tokens: int) -> None:
    """Runs `fused_moe` once per distinct tile configuration of batches of 1..`max_num_tokens` tokens (once per
    weight shape and process; the routing and the grouped GEMMs compile one variant per configuration)."""
    key = (tuple(w13.shape), tuple(w2.shape), w13.dtype, w13.device, top_k, renormalize, max_num_tokens)
    if key in _WARMED:
        return
    _WARMED.add(key)
    num_experts, hidden = w13.shape[0], w13.shape[2]
    sms = num_sms(w13.device) if w13.is_cuda else 16
    gate = torch.zeros(num_experts, hidden, dtype=w13.dtype, device=w13.device)
    sizes = sorted({min(1 << i, max_num_tokens) for i in range(max(1, max_num_tokens).bit_length() + 1)})
    seen: set[str] = set()
    for t in sizes:
        x = torch.zeros(t, hidden, dtype=w13.dtype, device=w13.device)
        sig = repr((_configs(x, w13, top_k), router_tiles(t, hidden, sms)))
        if sig in seen:
            continue
        seen.add(sig)
        logits = torch.zeros(t, num_experts, dtype=w13.dtype, device=w13.device)
        fused_moe(x, w13, w2, logits, top_k, renormalize, sum_experts=False)
        fused_moe(x, w13, w2, None, top_k, renormalize, sum_experts=False, gate_weight=gate)
