"""Reference attention backend in pure PyTorch over the paged KV cache (the CPU path).

KV cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_size].
Decode requests (one query token) run through the C kernel of `ops/cpu_paged_attn` on the CPU (reads the
paged cache in place, FP8 caches included), else as one batched gather + matmul in PyTorch (the reference
path, and the one used on other devices or without a C compiler); prefill chunks (which may attend to a
cached prefix) run through the blocked C kernel of `ops/cpu_prefill_attn` (K/V read from the cache in place;
an FP8 cache's blocks are dequantized to the query's dtype first), or, where it does not apply (soft-capping,
multimodal key limits, no C compiler), one request at a time through scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention import kv_quant
from pagedllm.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from pagedllm.attention.ops import cpu_paged_attn, cpu_prefill_attn
from pagedllm.model_executor.layers import batch_invariant

# Up to this many new tokens an FP8 cache is written by the C kernel (one thread, not vectorised: ~10 us saved a
# layer at one token); above it the PyTorch path below (vectorised, threaded) is faster: 0.13 against 0.35 ms for
# 512 tokens of SmolLM2's 3 x 64 K/V heads; the two break even at ~32 (Zen 5, 2 threads). The same bits either way.
_C_FP8_WRITE_MAX = 32


@dataclass
class PrefillSpan:
    q_start: int
    q_end: int
    context_len: int  # tokens already cached before this chunk
    seq_len: int  # context_len + chunk length
    blocks: torch.Tensor  # block ids covering seq_len


@dataclass
class TorchNativeMetadata:
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    causal: bool
    # Decodes, batched.
    decode_token_idx: torch.Tensor | None  # [D] positions in the flattened batch
    decode_block_table: torch.Tensor | None  # [D, nb]
    decode_seq_lens: torch.Tensor | None  # [D]
    # Prefill chunks (query length > 1), one by one.
    prefills: list[PrefillSpan]
    # Encoder-only: plain sequence spans.
    spans: list[tuple[int, int]]
    num_reqs: int = 0
    kv_cache_free: bool = False
    key_limit: torch.Tensor | None = None
    """Per token, the last key it may see (see `CommonAttentionMetadata.key_limit`); None: causal."""


class TorchNativeMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchNativeMetadata:
        """Decodes (one query token, causal) are found with array ops over the batch; only prefill chunks
        (query length > 1) get a Python object each."""
        n = common.num_reqs
        qsl_t = common.query_start_loc_cpu[: n + 1]
        qsl = qsl_t.numpy()
        qlen = qsl[1:] - qsl[:-1]
        seq_np = common.seq_lens_cpu[:n].numpy()
        qsl_list: list[int] = qsl_t.tolist()
        spans = list(zip(qsl_list, qsl_list[1:]))
        bs = self.block_size
        prefills: list[PrefillSpan] = []
        if n and common.causal and bool((qlen == 1).all()):
            # Every request decodes (steady decoding): slices (views) instead of gathers, the same values
            # as the general path below, without its per-row masks.
            nb = (int(seq_np.max()) + bs - 1) // bs
            return TorchNativeMetadata(
                slot_mapping=common.slot_mapping,
                num_actual_tokens=common.num_actual_tokens,
                causal=True,
                decode_token_idx=common.query_start_loc[:n].long(),
                decode_block_table=common.block_table[:n, :nb],
                decode_seq_lens=common.seq_lens[:n],
                prefills=prefills,
                spans=spans,
                num_reqs=n,
            )
        is_decode = (qlen == 1) if common.causal else np.zeros(n, dtype=bool)
        prefill_rows = np.flatnonzero((qlen > 0) & ~is_decode)
        if len(prefill_rows):
            ctx: list[int] = common.num_computed_tokens_cpu[:n].tolist()
            seq_lens: list[int] = seq_np.tolist()
            for r in prefill_rows.tolist():
                nb = (seq_lens[r] + bs - 1) // bs
                prefills.append(
                    PrefillSpan(qsl_list[r], qsl_list[r + 1], ctx[r], seq_lens[r], common.block_table[r, :nb])
                )
        dec_idx = dec_bt = dec_sl = None
        if is_decode.any():  # some, not all (that is the path above)
            dec_rows = np.flatnonzero(is_decode)
            rows = torch.from_numpy(dec_rows).to(common.block_table.device)
            dec_sl = common.seq_lens[rows]
            nb = (int(seq_np[dec_rows].max()) + bs - 1) // bs
            dec_bt = common.block_table[rows, :nb]
            dec_idx = common.query_start_loc[rows].long()
        return TorchNativeMetadata(
            slot_mapping=common.slot_mapping,
            num_actual_tokens=common.num_actual_tokens,
            causal=common.causal,
            decode_token_idx=dec_idx,
            decode_block_table=dec_bt,
            decode_seq_lens=dec_sl,
            prefills=prefills,
            spans=spans,
            num_reqs=n,
            kv_cache_free=common.kv_cache_free,
            key_limit=common.key_limit,
        )


def batch_invariant_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefills: list[PrefillSpan],
    output: torch.Tensor,
    impl: AttentionImpl,
) -> None:
    """Prefill chunks as rows of the decode kernel: query token i of a chunk attends to the first
    context_len + i + 1 cached positions (its K/V were written just before)."""
    idx, lens, tables = [], [], []
    width = max(p.blocks.numel() for p in prefills)
    for p in prefills:
        n = p.q_end - p.q_start
        idx.append(torch.arange(p.q_start, p.q_end))
        lens.append(torch.arange(p.context_len + 1, p.context_len + n + 1, dtype=torch.int32))
        row = torch.zeros(width, dtype=torch.int32)
        row[: p.blocks.numel()] = p.blocks.to(torch.int32)
        tables.append(row.expand(n, width))
    cpu_paged_attn.paged_decode(
        query,
        k_cache,
        v_cache,
        torch.cat(tables).contiguous(),
        torch.cat(lens),
        torch.cat(idx),
        output,
        impl.scale,
        impl.sliding_window,
    )


class TorchNativeAttentionImpl(AttentionImpl[TorchNativeMetadata]):
    _use_c_kernels: bool | None = None  # decided at the first forward, from the cache's dtype and device
    _use_c_prefill: bool | None = None  # likewise, for the C prefill kernel
    _use_c_prefill_fp8: bool | None = None  # the C prefill kernel over an FP8 cache's dequantized blocks
    _use_c_fp8: bool | None = None  # the C cache write and decode kernel over an FP8 cache

    def _c_kernels(self, kv_cache: torch.Tensor) -> bool:
        if self._use_c_kernels is None:
            self._use_c_kernels = (
                self.logits_soft_cap is None  # the C kernels do not soft-cap; the PyTorch paths below do
                and kv_cache.device.type == "cpu"
                and kv_cache[0].is_contiguous()
                and cpu_paged_attn.supports(kv_cache.dtype, self.num_heads, self.num_kv_heads, self.head_size)
            )
        if self._use_c_prefill is None:
            self._use_c_prefill = self._use_c_kernels and cpu_prefill_attn.supports(
                kv_cache.dtype, self.num_heads, self.num_kv_heads, self.head_size
            )
        return self._use_c_kernels

    def _c_fp8(self, kv_cache: torch.Tensor) -> bool:
        """The C kernels write and decode an FP8 cache in place (`_c_kernels` stays False for it: prefill keeps
        `_prefill_fp8`, and batch-invariant mode its PyTorch paths)."""
        if self._use_c_fp8 is None:
            self._use_c_fp8 = (
                self.logits_soft_cap is None
                and self.kv_scales is not None
                and kv_cache.device.type == "cpu"
                and kv_cache[0].is_contiguous()
                and cpu_paged_attn.supports_fp8(kv_cache.dtype, self.num_heads, self.num_kv_heads, self.head_size)
            )
        return self._use_c_fp8

    def _c_prefill_fp8(self, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        if self._use_c_prefill_fp8 is None:
            self._use_c_prefill_fp8 = (
                self.logits_soft_cap is None
                and kv_cache.device.type == "cpu"
                and kv_cache[0].is_contiguous()
                and cpu_prefill_attn.supports(query.dtype, self.num_heads, self.num_kv_heads, self.head_size)
            )
        return self._use_c_prefill_fp8

    def _prefill_fp8(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        prefills: list[PrefillSpan],
        output: torch.Tensor,
    ) -> None:
        """Every chunk in one call of the C prefill kernel over the chunks' blocks of an FP8 cache, dequantized
        to the query's dtype (exact for e4m3/e5m2 with scale 1.0): each query row then sees the same keys in
        the same reduction order whatever the chunking (a masked SDPA's rounding moved with its row count)."""
        assert self.kv_scales is not None
        bs = k_cache.shape[1]
        blocks = [p.blocks[: (p.seq_len + bs - 1) // bs] for p in prefills]
        ids = torch.cat(blocks).long()
        k = kv_quant.dequantize(k_cache.view(torch.uint8)[ids].view(k_cache.dtype), self.kv_scales[0], query.dtype)
        v = kv_quant.dequantize(v_cache.view(torch.uint8)[ids].view(v_cache.dtype), self.kv_scales[1], query.dtype)
        spans, off = [], 0
        for p, b in zip(prefills, blocks):
            table = torch.arange(off, off + b.numel(), dtype=torch.int32)
            spans.append(PrefillSpan(p.q_start, p.q_end, p.context_len, p.seq_len, table))
            off += b.numel()
        cpu_prefill_attn.prefill(query, k, v, spans, output, self.scale, self.sliding_window)

    def forward(
        self, query, key, value, kv_cache, attn_metadata: TorchNativeMetadata, output, rotary=None, kv_written=False
    ):
        assert rotary is None and not kv_written, "this backend does not fuse RoPE (fuses_rotary, qkv_rope)"
        n = attn_metadata.num_actual_tokens
        if attn_metadata.kv_cache_free and self.attn_type != AttentionType.ENCODER_ONLY:
            return output.zero_()  # the start-up memory profile: no kernel (`CommonAttentionMetadata.kv_cache_free`)
        if self.attn_type == AttentionType.ENCODER_ONLY:
            for q0, q1 in attn_metadata.spans:
                output[q0:q1] = self._sdpa(query[q0:q1], key[q0:q1], value[q0:q1], None, causal=False)
            return output
        assert kv_cache is not None
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        kvh, hd = self.num_kv_heads, self.head_size
        slots = attn_metadata.slot_mapping[:n]
        use_c = self._c_kernels(kv_cache)
        fp8 = kv_quant.is_fp8(kv_cache.dtype)  # cache = fp8(x / scale), see attention/kv_quant.py
        c_fp8 = fp8 and self._c_fp8(kv_cache)
        if use_c:
            cpu_paged_attn.reshape_and_cache(key[:n], value[:n], k_cache, v_cache, slots)
        elif c_fp8 and n <= _C_FP8_WRITE_MAX:  # kv_quant.quantize's bits, in place
            cpu_paged_attn.reshape_and_cache(key[:n], value[:n], k_cache, v_cache, slots, self.kv_scales)
        elif fp8:
            assert self.kv_scales is not None
            ks, vs = self.kv_scales
            # As bytes: the CPU index ops have no FP8 kernels.
            kq = kv_quant.quantize(key[:n], ks, k_cache.dtype).view(torch.uint8)
            vq = kv_quant.quantize(value[:n], vs, v_cache.dtype).view(torch.uint8)
            k_cache.view(torch.uint8).view(-1, kvh, hd).index_copy_(0, slots, kq)
            v_cache.view(torch.uint8).view(-1, kvh, hd).index_copy_(0, slots, vq)
        else:
            # index_copy_ (a row memcpy per slot) is several times faster than advanced-index assignment.
            k_cache.view(-1, kvh, hd).index_copy_(0, slots, key[:n].to(k_cache.dtype))
            v_cache.view(-1, kvh, hd).index_copy_(0, slots, value[:n].to(v_cache.dtype))

        limit = attn_metadata.key_limit  # (a one-token query's limit is its own position: decodes ignore it)
        bi = use_c and limit is None and batch_invariant.enabled() and cpu_paged_attn.can_decode(query, output, k_cache)
        if bi and attn_metadata.prefills:
            # One kernel, one reduction order for every query token (see layers/batch_invariant.py).
            batch_invariant_prefill(query, k_cache, v_cache, attn_metadata.prefills, output, self)
        c_prefill = (
            not bi
            and limit is None
            and bool(attn_metadata.prefills)
            and bool(self._use_c_prefill)
            and cpu_prefill_attn.can_run(query, output, k_cache)
        )
        if c_prefill:  # every chunk in one call, fresh prompts and cached prefixes alike
            prefills = attn_metadata.prefills
            cpu_prefill_attn.prefill(query, k_cache, v_cache, prefills, output, self.scale, self.sliding_window)
        elif (
            fp8
            and limit is None
            and bool(attn_metadata.prefills)
            and self._c_prefill_fp8(query, kv_cache)
            and cpu_prefill_attn.can_run(query, output, query.new_empty(0))
        ):
            self._prefill_fp8(query, k_cache, v_cache, attn_metadata.prefills, output)
            c_prefill = True
        for p in attn_metadata.prefills if not (bi or c_prefill) else ():
            q = query[p.q_start : p.q_end]
            if p.context_len == 0 and self.sliding_window is None and not fp8 and limit is None:
                # Whole prompt in this chunk: causal attention over the fresh K/V, no gather needed (an
                # FP8 cache is read back instead, so every token attends to the same quantized K/V).
                output[p.q_start : p.q_end] = self._sdpa(
                    q, key[p.q_start : p.q_end], value[p.q_start : p.q_end], None, causal=True
                )
                continue
            if fp8:
                assert self.kv_scales is not None
                k = kv_quant.gather_dequantized(k_cache, p.blocks, p.seq_len, self.kv_scales[0], q.dtype)
                v = kv_quant.gather_dequantized(v_cache, p.blocks, p.seq_len, self.kv_scales[1], q.dtype)
            else:
                k = k_cache[p.blocks].flatten(0, 1)[: p.seq_len]
                v = v_cache[p.blocks].flatten(0, 1)[: p.seq_len]
            q_pos = torch.arange(p.context_len, p.seq_len, device=q.device)[:, None]
            k_pos = torch.arange(p.seq_len, device=q.device)[None, :]
            mask = k_pos <= (q_pos if limit is None else limit[p.q_start : p.q_end, None])
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            output[p.q_start : p.q_end] = self._sdpa(q, k, v, mask, causal=False)

        if attn_metadata.decode_token_idx is not None:
            idx = attn_metadata.decode_token_idx
            if (use_c or c_fp8) and cpu_paged_attn.can_decode(query, output, k_cache):
                cpu_paged_attn.paged_decode(
                    query,
                    k_cache,
                    v_cache,
                    attn_metadata.decode_block_table,  # type: ignore[arg-type]
                    attn_metadata.decode_seq_lens,  # type: ignore[arg-type]
                    idx,
                    output,
                    self.scale,
                    self.sliding_window,
                    self.kv_scales if c_fp8 else None,
                )
            else:
                output[idx] = self._decode(query[idx], k_cache, v_cache, attn_metadata)
        return output

    def _sdpa(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        # [L, H, D] -> [H, L, D]; GQA by repeating K/V heads (group sizes need not be powers of two).
        g = self.num_heads // self.num_kv_heads
        # Contiguous [H, L, D]: strided inputs send the CPU SDPA kernel down a far slower path.
        qh = q.transpose(0, 1).contiguous()
        kh = k.transpose(0, 1).to(q.dtype).contiguous()
        vh = v.transpose(0, 1).to(q.dtype).contiguous()
        if g > 1:
            kh = kh.repeat_interleave(g, dim=0)
            vh = vh.repeat_interleave(g, dim=0)
        cap = self.logits_soft_cap
        if cap is not None:  # SDPA cannot soft-cap: the same product written out, in float32
            scores = torch.matmul(qh.float(), kh.float().transpose(1, 2)) * self.scale
            scores = torch.tanh(scores / cap) * cap
            if causal:
                n_q, n_k = scores.shape[1], scores.shape[2]
                mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), vh.float()).to(q.dtype)
            return out.transpose(0, 1)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=self.scale)
        return out.transpose(0, 1)

    def _decode(self, q, k_cache, v_cache, md: TorchNativeMetadata) -> torch.Tensor:
        """Batched decode: gather the requests' blocks with index_select (contiguous block copies), lay
        K/V out head-major in one copy, then one batched matmul for scores and one for the output (a
        strided bmm per head falls back to a per-matrix loop on the CPU)."""
        d_reqs = q.shape[0]
        kvh, hd, g = self.num_kv_heads, self.head_size, self.num_heads // self.num_kv_heads
        bt = md.decode_block_table
        nb, bs = bt.shape[1], k_cache.shape[1]  # type: ignore[union-attr]
        flat = bt.reshape(-1).long()  # type: ignore[union-attr]
        length = nb * bs
        kv_dtype = k_cache.dtype
        fp8 = kv_quant.is_fp8(kv_dtype)
        if fp8:  # gathered as bytes (no FP8 index kernels on the CPU), then widened and scaled below
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k = k_cache.index_select(0, flat).view(d_reqs, length, kvh, hd).transpose(1, 2)
        v = v_cache.index_select(0, flat).view(d_reqs, length, kvh, hd).transpose(1, 2)
        if fp8:
            assert self.kv_scales is not None
            k = kv_quant.dequantize(k.contiguous().view(kv_dtype), self.kv_scales[0], torch.float32)
            v = kv_quant.dequantize(v.contiguous().view(kv_dtype), self.kv_scales[1], torch.float32)
        k = k.to(torch.float32, memory_format=torch.contiguous_format)  # [D, kvh, L, hd]
        v = v.to(torch.float32, memory_format=torch.contiguous_format)
        qg = q.view(d_reqs, kvh, g, hd).float()
        scores = torch.matmul(qg, k.transpose(2, 3)).mul_(self.scale)  # [D, kvh, g, L]
        if self.logits_soft_cap is not None:
            scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        pos = torch.arange(length, device=q.device)[None, :]
        seq = md.decode_seq_lens[:, None].long()  # type: ignore[index]
        valid = pos < seq
        if self.sliding_window is not None:
            valid &= pos >= seq - self.sliding_window
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [D, kvh, g, hd]
        return out.reshape(d_reqs, self.num_heads, hd).to(q.dtype)


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchNativeAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchNativeMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)
