"""Triton attention backend (the CUDA path): one kernel launch per layer for a whole mixed batch.

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_size], as the CPU backend.
The metadata is the step's device tensors as the model runner gives them plus a few host ints; the
builder does no per-request work and never reads a device tensor back, so building is O(1).

CUDA graphs (pure decode): every tensor the kernels read is a fixed-shape input the runner can keep
in persistent buffers (query_start_loc, seq_lens, block_table, slot_mapping). Padded requests are
fine: a request with seq_len 0 yields zeros, and slot -1 tokens are not written to the cache. The
kernel variant depends only on host ints fixed per captured batch size (num_reqs, max_query_len == 1,
num_actual_tokens), never on context lengths.

Raises ImportError at import when Triton is missing, so the selector falls back to torch_native.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm import envs
from pagedllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    RotaryArgs,
)
from pagedllm.attention.ops.triton_paged_attn import (
    HAS_TRITON,
    DecodeRope,
    choose_num_splits,
    paged_attention,
    request_order,
    reshape_and_cache,
    wants_request_order,
    writes_q8_twin,
)
from pagedllm.attention.ops.triton_rope_cache import KVCacheWrite, apply_rotary_
from pagedllm.attention.qkv_rope import QKVRope

if not HAS_TRITON:
    raise ImportError("the Triton attention backend needs the triton package")


@dataclass
class TritonAttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device
    query_start_loc_cpu: torch.Tensor  # host copy (encoder-only spans)
    seq_lens: torch.Tensor  # [num_reqs] int32, device
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, device
    slot_mapping: torch.Tensor  # [num_tokens] int64, device; -1 = don't write
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    causal: bool
    kv_cache_free: bool = False
    num_decodes: int | None = None  # requests with exactly one query token (host int)
    num_splits: int | None = None  # split-KV segments; None = choose per layer from the batch shape
    workspace: dict = field(default_factory=dict)  # split-KV scratch, shared by the step's layers
    key_limit: torch.Tensor | None = None  # [num_tokens] int32: see CommonAttentionMetadata.key_limit
    # Longest-first request order for the decode launch, computed on the device by the first layer that runs
    # with this metadata (`order_owner`, an impl's id) in every forward, so that a CUDA graph captures the sort
    # and replays it on the replayed lengths; later layers reuse it. Any permutation gives the same output.
    req_order: torch.Tensor | None = None
    order_owner: int | None = None


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        bt = common.block_table
        if bt.dtype != torch.int32:
            bt = bt.to(torch.int32)
        # Host-side and vectorised: how many requests are single-token decodes (picks the launch split).
        qsl = common.query_start_loc_cpu[: common.num_reqs + 1]
        num_decodes = int((qsl[1:] - qsl[:-1] == 1).sum()) if common.causal else 0
        return TritonAttentionMetadata(
            query_start_loc=common.query_start_loc,
            query_start_loc_cpu=common.query_start_loc_cpu,
            seq_lens=common.seq_lens,
            block_table=bt,
            slot_mapping=common.slot_mapping,
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=common.num_reqs,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
            causal=common.causal,
            kv_cache_free=common.kv_cache_free,
            num_decodes=num_decodes,
            key_limit=common.key_limit,
        )


class TritonAttentionImpl(AttentionImpl[TritonAttentionMetadata]):
    def configure(self) -> None:
        # RoPE fused with the KV-cache write (NOTES session 5 #1; PAGEDLLM_FUSED_ROPE_CACHE=0 turns it off).
        self.fuses_rotary = self.attn_type == AttentionType.DECODER and envs.PAGEDLLM_FUSED_ROPE_CACHE
        # Longest-first decode launches (`wants_request_order`; PAGEDLLM_ATTN_LONGEST_FIRST=0 turns them off).
        self.longest_first = envs.PAGEDLLM_ATTN_LONGEST_FIRST

    def _decode_rope(
        self, rotary: RotaryArgs, key: torch.Tensor, value: torch.Tensor, md: TritonAttentionMetadata
    ) -> DecodeRope | None:
        """The decode step's RoPE + cache write for the attention launch to do (`PAGEDLLM_ATTN_FUSED_ROPE`), where
        it can: one query token a request, no q/k norm, the whole head rotary (a power of two), a 16/32-bit cache
        (the caller's check)."""
        hs = self.head_size
        if not (
            md.max_query_len == 1
            and envs.PAGEDLLM_ATTN_FUSED_ROPE  # (read here: decode graphs captured again see a change)
            and rotary.q_weight is None
            and rotary.rotary_dim == hs
            and hs & (hs - 1) == 0
            and rotary.positions.dim() == 1
        ):
            return None
        return DecodeRope(rotary.positions, rotary.cos_sin_cache, key, value, md.slot_mapping)

    def qkv_rope(
        self, rotary: RotaryArgs, kv_cache: torch.Tensor, attn_metadata: TritonAttentionMetadata
    ) -> QKVRope | None:
        """Decode steps (`PAGEDLLM_QKV_ROPE`): the whole head rotary, no q/k norm, a 16-bit cache."""
        md = attn_metadata
        if not (
            envs.PAGEDLLM_QKV_ROPE  # (read here: decode graphs captured again see a change)
            and self.attn_type == AttentionType.DECODER
            and md.max_query_len == 1
            and not md.kv_cache_free
            and kv_cache.element_size() == 2
            and rotary.q_weight is None
            and rotary.rotary_dim == self.head_size
            and rotary.cos_sin_cache.dtype == torch.float32
        ):
            return None
        return QKVRope(
            rotary.positions,
            rotary.cos_sin_cache,
            md.slot_mapping,
            kv_cache,
            md.num_actual_tokens,
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
        )

    def _num_splits(self, md: TritonAttentionMetadata, device: torch.device) -> int:
        if md.num_splits is not None:
            return md.num_splits
        return choose_num_splits(md.num_reqs, self.num_kv_heads, md.max_query_len, device)

    def writes_q8_twin(self, attn_metadata: TritonAttentionMetadata) -> bool:
        """Split-KV steps: the launch's merge writes the twin (`paged_attention`'s `q8_twin`)."""
        md = attn_metadata
        return (
            self.attn_type == AttentionType.DECODER
            and not md.kv_cache_free
            and writes_q8_twin(self._num_splits(md, md.seq_lens.device), self.head_size)
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        rotary: RotaryArgs | None = None,
        kv_written: bool = False,
        q8_twin: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        md = attn_metadata
        n = md.num_actual_tokens
        if md.kv_cache_free and self.attn_type != AttentionType.ENCODER_ONLY:
            return output.zero_()  # the start-up memory profile: no kernel (`CommonAttentionMetadata.kv_cache_free`)
        if self.attn_type == AttentionType.ENCODER_ONLY:
            return self._encoder_forward(query, key, value, md, output)
        assert kv_cache is not None, "decoder attention needs its KV cache"
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        kv_scales = self.kv_scales if k_cache.element_size() == 1 else None  # FP8 cache (attention/kv_quant.py)
        if rotary is not None and kv_scales is not None:  # the fused RoPE + write stores 16-bit values
            apply_rotary_(rotary, query, key, self.head_size)
            rotary = None
        rope = self._decode_rope(rotary, key, value, md) if rotary is not None else None
        if kv_written:
            assert rotary is None, "kv_written: RoPE was applied with the cache write (qkv_rope)"
        elif rotary is None:
            reshape_and_cache(key[:n], value[:n], k_cache, v_cache, md.slot_mapping, kv_scales)
        elif rope is None:
            apply_rotary_(rotary, query, key, self.head_size, KVCacheWrite(value, k_cache, v_cache, md.slot_mapping, n))
        num_splits = self._num_splits(md, query.device)
        req_order = None
        if self.longest_first and wants_request_order(
            md.num_reqs, self.num_kv_heads, md.num_decodes or 0, num_splits, query.device
        ):
            if md.order_owner is None:
                md.order_owner = id(self)
            if md.order_owner == id(self):
                md.req_order = request_order(md.seq_lens, md.num_reqs)
            req_order = md.req_order
        paged_attention(
            query,
            k_cache,
            v_cache,
            output,
            md.block_table,
            md.seq_lens,
            md.query_start_loc,
            num_actual_tokens=n,
            num_reqs=md.num_reqs,
            max_query_len=md.max_query_len,
            scale=self.scale,
            sliding_window=self.sliding_window,
            causal=md.causal,
            num_splits=num_splits,
            workspace=md.workspace,
            num_decodes=md.num_decodes,
            logits_soft_cap=self.logits_soft_cap,
            kv_scales=kv_scales,
            key_limit=md.key_limit,
            req_order=req_order,
            q8_twin=q8_twin,
            rope=rope,
        )
        return output

    def _encoder_forward(self, query, key, value, md: TritonAttentionMetadata, output):
        """Bidirectional attention within each sequence, no cache: SDPA per sequence (host spans only)."""
        qsl = md.query_start_loc_cpu.tolist()
        gqa = self.num_heads != self.num_kv_heads
        for r in range(md.num_reqs):
            q0, q1 = qsl[r], qsl[r + 1]
            if q1 <= q0:
                continue
            out = F.scaled_dot_product_attention(
                query[q0:q1].transpose(0, 1),
                key[q0:q1].transpose(0, 1),
                value[q0:q1].transpose(0, 1),
                scale=self.scale,
                enable_gqa=gqa,
            )
            output[q0:q1] = out.transpose(0, 1)
        return output


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
