"""RoPE and the new K / V's paged-cache write as the epilogue of a qkv projection's kernel, for decode steps: the
projection's programs hold whole rotation pairs of one head (`rope_pair_rows`), read their positions' cos / sin
and cache slots before their PDL wait (`rope_pair_inputs`), and store q and k rotated, v as is, and k and v also
at the token's slot (`rope_pair_store`), rounded as `triton_rope_cache._rope_kernel` rounds them: the same bits
as the projection followed by that launch, which the step then skips.

`QKVRope` is what a backend offers (`AttentionImpl.qkv_rope`) and a linear method's kernel takes (the GGUF int8
GEMV, `gguf_triton.rope_fits`). Kept apart from `attention/ops` so that the quantized GEMV kernels can import
the epilogue without the attention kernels (which import their q8 quantizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    from pagedllm.triton_utils import product_in

    @triton.jit
    def rope_pair_rows(pid_n, BN: tl.constexpr, HEAD: tl.constexpr):
        """The BN output rows of program pid_n of a qkv GEMV with the RoPE epilogue (`QKVRope`): BN / 2 rotation
        pairs (j, j + HEAD / 2) of one head, so the program holds both halves of each; over the programs, every
        row once. Returns (head, the pairs' j [BN / 2], rows [BN])."""
        H2: tl.constexpr = BN // 2
        PPH: tl.constexpr = (HEAD // 2) // H2  # programs a head
        head = pid_n // PPH
        j = (pid_n % PPH) * H2 + tl.arange(0, H2)
        i = tl.arange(0, BN)
        return head, j, head * HEAD + (pid_n % PPH) * H2 + i % H2 + (i // H2) * (HEAD // 2)

    @triton.jit
    def rope_pair_inputs(pos_ptr, cos_sin_ptr, stride_cs, slot_ptr, t, n_tok, j, HALF: tl.constexpr,
                         dt: tl.constexpr):  # fmt: skip
        """Token t's cos / sin at dims j (in `dt`, as float32, as the RoPE kernel casts the table) and its cache
        slot (-1: padding or past n_tok): the step's inputs and a constant table, read before the PDL wait."""
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cs = cos_sin_ptr + pos * stride_cs + j
        cos = tl.load(cs).to(dt).to(tl.float32)
        sin = tl.load(cs + HALF).to(dt).to(tl.float32)
        slot = tl.load(slot_ptr + t, mask=t < n_tok, other=-1).to(tl.int64)
        return cos, sin, slot

    @triton.jit
    def rope_pair_store(res, out_row, head, j, cos, sin, slot, kv_ptr, v_off, stride_cb, stride_ct, stride_ch,
                        q_heads, kv_heads, BN: tl.constexpr, HEAD: tl.constexpr,
                        CACHE_BLOCK: tl.constexpr):  # fmt: skip
        """A qkv GEMV program's float32 sums `res` [BN] of `rope_pair_rows`' rows, stored as the GEMV, the RoPE
        kernel and its cache write would leave them (`_rope_kernel`, the same roundings: the sum to the output
        dtype, each product in it): q and k heads rotated, k and v heads also written to the token's cache slot
        (kv_ptr: the layer's K half, v_off elements on to its V half)."""
        dt = out_row.dtype.element_ty
        H2: tl.constexpr = BN // 2
        HALF: tl.constexpr = HEAD // 2
        x = res.to(dt).to(tl.float32)
        xa, xb = tl.split(tl.permute(tl.reshape(x, [2, H2]), (1, 0)))
        rot = head < q_heads + kv_heads
        oa = tl.where(rot, product_in(xa, cos, dt) - product_in(xb, sin, dt), xa).to(dt)
        ob = tl.where(rot, product_in(xb, cos, dt) + product_in(xa, sin, dt), xb).to(dt)
        row = head * HEAD + j
        tl.store(out_row + row, oa)
        tl.store(out_row + row + HALF, ob)
        if head >= q_heads:
            if slot >= 0:
                cdt = kv_ptr.dtype.element_ty
                kvh = (head - q_heads) % kv_heads
                v = (head >= q_heads + kv_heads).to(tl.int64)
                dst = kv_ptr + v * v_off + (slot // CACHE_BLOCK) * stride_cb + (slot % CACHE_BLOCK) * stride_ct
                dst += kvh * stride_ch + j
                tl.store(dst, oa.to(cdt))
                tl.store(dst + HALF, ob.to(cdt))


@dataclass
class QKVRope:
    """RoPE and the new K/V's cache write for a qkv GEMV to do in its epilogue (`rope_pair_store`) instead of
    `rotary_embedding_`'s launch: the decode steps of a Triton attention backend (`TritonAttentionImpl.qkv_rope`).
    Neox style over whole heads, no q/k norm; the output is [T, (q_heads + 2 * kv_heads) * head_size], the cache
    [2, blocks, block_size, kv_heads, head_size], slot -1 (or a token past `num_tokens`) writes nothing."""

    positions: torch.Tensor  # [T] (read before the GEMV's PDL wait: the step's input, not a fresh copy)
    cos_sin_cache: torch.Tensor  # float32 [max_positions, head_size]
    slot_mapping: torch.Tensor
    kv_cache: torch.Tensor
    num_tokens: int
    q_heads: int
    kv_heads: int
    head_size: int

    def kernel_args(self) -> tuple:
        """The GEMV kernel's RoPE arguments, in its order."""
        kc, vc = self.kv_cache[0], self.kv_cache[1]
        v_off = (vc.data_ptr() - kc.data_ptr()) // kc.element_size()
        return (self.positions, self.cos_sin_cache, self.slot_mapping, kc, self.cos_sin_cache.stride(0), v_off,
                kc.stride(0), kc.stride(1), kc.stride(2), self.num_tokens, self.q_heads, self.kv_heads)  # fmt: skip
