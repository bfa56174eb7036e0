"""Paged attention on the GPU: the launcher of the Triton kernels in `triton_paged_attn_kernels.py` (one
attention kernel for mixed batches; the KV-cache write is in `triton_kv_write.py`, re-exported here), with
its tile and split-KV heuristics.

Cache layout (one layer): `k_cache`, `v_cache` are each `[num_blocks, block_size, num_kv_heads, head_size]`
(the two halves of the backend's `[2, num_blocks, block_size, num_kv_heads, head_size]` tensor).

`paged_attention` runs a whole batch in one launch: every request is a run of query tokens
(`query_start_loc`) whose last token sits at position `seq_len - 1`; a prefill chunk attends to its
cached prefix plus itself (causal), a decode is a run of length 1. One program owns one tile of query
rows for ONE kv head: rows are (query token, q head of that kv head's group) pairs, so each K/V tile is
read once for all q heads sharing it (GQA/MQA), which is what makes decode bandwidth-efficient.
Programs are numbered so that request r's tiles start at `query_start_loc[r] // BLOCK_Q + r`; a program
finds its request by binary search over `query_start_loc` -- no host-side per-request work. Decode
launches (every request one tile) use one program per request instead.

With `num_splits > 1` (flash-decoding) the key range of every query tile is cut into that many
segments, run by separate programs, each writing an unnormalised partial (acc, running max, sum); the
last of a tile's programs to finish merges them (a per-tile arrival count, `_split_counts`), and may also
write the output rows' q8_1 quantization for o_proj's int8 GEMV (`q8_twin`). That path exists for batches
with few (kv head, request) pairs and long contexts, where one program per pair cannot fill the GPU.

Importing this module never calls Triton (the kernels compile on first launch) and works without
Triton installed (`HAS_TRITON` is then False and the launchers raise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm import envs
from pagedllm.attention.ops.triton_kv_write import reshape_and_cache
from pagedllm.model_executor.layers import batch_invariant
from pagedllm.triton_utils import HAS_TRITON, num_sms, pdl_args, require_triton
from pagedllm.utils import next_pow2

__all__ = [
    "HAS_TRITON",
    "DecodeRope",
    "choose_num_splits",
    "launch_config",
    "one_tile_rows",
    "paged_attention",
    "request_order",
    "reshape_and_cache",
    "wants_request_order",
    "writes_q8_twin",
]

if HAS_TRITON:
    import triton

    from pagedllm.attention.ops import triton_paged_attn_kernels as kern

_LOG2E = 1.4426950408889634


@dataclass
class DecodeRope:
    """What a decode launch (one query token a request) also does before attending, instead of
    `rotary_embedding_`'s launch: RoPE on q (as read) and on the new k, and the new k / v written to their cache
    slots (`slot_mapping`, -1: nothing), by the program whose key tiles hold the new position. Neox RoPE over the
    whole head (`cos_sin_cache` float32 [positions, head_size]: cos halves, then sin halves), a 16-bit or
    float32 cache. `key` / `value` [T, kv_heads * head_size] (or [T, kv_heads, head_size]) with packed heads."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_query_len: int, device: torch.device) -> int:
    """Segments per query tile for the split-KV path: >1 only for pure-decode batches under one wave. (The
    kernel also splits launches of a few query rows per request, but speculative verification at batch 1 ran
    no faster with them on its short contexts (H100, benchmarks/NOTES.md, session 23), and every split count
    is one more compile variant for small prompt-only steps.)

    With 128-key tiles a decode program holds ~128 KB of shared memory, so one runs per SM: a batch of
    fewer (request, kv head) pairs than SMs leaves SMs idle (figures: benchmarks/NOTES.md, "Tuning
    figures behind code heuristics"). Depends on host-known batch shape only (never on context lengths), so
    a CUDA graph captured for a batch size stays a good choice whatever lengths are replayed through it.
    """
    if max_query_len != 1 or device.type != "cuda":
        return 1
    if envs.PAGEDLLM_ATTN_DECODE_SPLITS > 0:  # (a fixed count, for measurements)
        return envs.PAGEDLLM_ATTN_DECODE_SPLITS
    sms = num_sms(device)
    ratio = (2 * sms) // max(1, num_reqs * num_kv_heads)
    if ratio < 2:
        return 1
    return min(16, 1 << (ratio.bit_length() - 1))  # largest power of two <= ratio


def wants_request_order(
    num_reqs: int, num_kv_heads: int, num_decodes: int, num_splits: int, device: torch.device
) -> bool:
    """Whether the step's decode launch should run its (request, kv head) programs longest request first: only
    where there are more of them than SMs (with one program per SM, launch order is the schedule, and a long
    request started last is the launch's tail; a simulation of W6's contexts, 100-1,100 keys at batch 256, gives
    a 12 % longer launch in batch order than longest-first) and only for one-segment decode launches."""
    return num_decodes > 0 and num_splits == 1 and device.type == "cuda" and num_reqs * num_kv_heads > num_sms(device)


SMALL_TILE_WAVES = 6
"""Longest-first decode launches of at least this many (request, kv head) programs per SM use 64-key tiles."""


def ordered_tile_n(tile_n: int, pairs: int, device: torch.device) -> int:
    """The key tile of a longest-first decode launch: 64 keys (two stages of K and V in 64 KB, three programs per
    SM, so one program's start and end overlap the others' loads) where there are at least `SMALL_TILE_WAVES`
    programs per SM. Fewer programs do better with 128-key tiles (H200, attn_order_ab.py: W6's 32/4 heads at
    batch 256, 82.2 -> 75.0 us; at batch 128, 63.2 -> 69.1 us; benchmarks/NOTES.md, session 30)."""
    if device.type != "cuda" or pairs < SMALL_TILE_WAVES * num_sms(device):
        return tile_n
    return min(tile_n, 64)


def request_order(seq_lens: torch.Tensor, num_reqs: int) -> torch.Tensor:
    """[num_reqs] int32 request indices by descending context length, ties in index order: one launch, no host
    sync, graph-capturable (torch's stable argsort took 18.5 us at 256 requests on the H200, several launches)."""
    require_triton()
    order = torch.empty(num_reqs, dtype=torch.int32, device=seq_lens.device)
    if num_reqs:
        block = 64
        kern._longest_first_kernel[(triton.cdiv(num_reqs, block),)](seq_lens, order, num_reqs, BLOCK=block)
    return order


def one_tile_rows(max_query_len: int, group: int) -> int | None:
    """BLOCK_M of a launch where every request's query rows fit one tile (decodes; speculative verification's
    k + 1 rows), else None. Up to 32 rows, so that k = 5..7 verifications (SmolLM2's group of 3: 18-24 rows) do
    not fall to the 128-row prefill tile (k = 5 cost 1.14 ms a step against 0.98 at k = 4, H200,
    benchmarks/NOTES.md, session 22)."""
    min_m = max(16, next_pow2(group))
    if max_query_len == 1:
        return min_m
    rows = max_query_len * group
    return None if rows > 32 else max(min_m, next_pow2(rows))


def launch_config(head_size: int, group: int, dtype: torch.dtype, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for a batch; BLOCK_M counts (token, q head) rows."""
    head_pad = next_pow2(head_size)
    elem = 4 if dtype == torch.float32 else 2
    min_m = max(16, next_pow2(group))
    one_tile = one_tile_rows(max_query_len, group)
    if one_tile is not None:  # decode-dominated: a single tile per request
        # Big key tiles keep many bytes in flight (NOTES, tuning figures); one K tile at most 32 KB so two
        # stages of K and V fit in shared memory.
        tile_n = max(16, min(128, 32768 // (head_pad * elem)))
        return one_tile, tile_n, 4, 2
    if elem == 4 or head_pad > 128:  # bigger per-row footprint: smaller tiles
        return max(min_m, 64), 32, 8, 2
    # 128 rows x 32 keys; 8 warps for GQA group 2, 4 for group >= 4 (NOTES, tuning figures).
    return max(min_m, 128), 32, (4 if group >= 4 else 8), 3


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_size]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor,
    output: torch.Tensor,  # [T, num_heads, head_size], written for the first num_actual_tokens rows
    block_table: torch.Tensor,  # [>= num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= num_reqs] int32, context length including this step's tokens
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    *,
    num_actual_tokens: int,
    num_reqs: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    causal: bool = True,
    num_splits: int = 1,
    workspace: dict | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_decodes: int | None = None,
    logits_soft_cap: float | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_limit: torch.Tensor | None = None,
    req_order: torch.Tensor | None = None,
    q8_twin: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rope: DecodeRope | None = None,
    early: bool | None = None,
) -> torch.Tensor:
    """Attention of every query token over its request's paged K/V (see the module docstring).

    `workspace` (any dict kept for the step) caches the split-KV scratch buffers across layers.
    `num_decodes` (requests with one query token, if known on the host) lets a mixed batch run as two
    launches with tiles suited to each part. block_m/tile_n/num_warps/num_stages override the
    heuristics (benchmarks, tests) and force a single launch. An FP8 cache (1-byte elements) is read back
    as cache * scale with the layer's `kv_scales` (float32 [1] tensors, attention/kv_quant.py).
    `key_limit` ([T] int32, causal only): the last key position each query token may see instead of its own
    (`CommonAttentionMetadata.key_limit`); None compiles and runs the plain causal kernel.
    `req_order` (`request_order`'s [num_reqs] permutation): the order in which a one-segment decode launch runs
    its requests (see `wants_request_order`); other launches ignore it. It changes no value of the output.
    `q8_twin` (an `act_twin.Q8Act`'s q [T, heads * head_size] int8, d and s [T, heads * head_size / 32]
    float32; split-KV launches only, `writes_q8_twin`): the output rows quantized as `quant_groups_q8`
    quantizes them. `rope` (decode steps, `max_query_len` 1): q and the new k rotated and the new k / v cached
    in this launch (`DecodeRope`); query is then the unrotated q. `early` (tests): whether a one-tile decode launch
    reads its lengths and first block ids before the PDL wait (None: in PDL launches, see the kernel's `EARLY`).
    """
    require_triton()
    if num_actual_tokens == 0 or num_reqs == 0:
        return output
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert query.stride(-1) == 1 and output.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_table.stride(-1) == 1
    group = num_heads // num_kv_heads
    head_pad = next_pow2(head_size)
    num_splits = max(1, next_pow2(num_splits))
    use_window = sliding_window is not None and sliding_window > 0
    dot_prec = "ieee" if query.dtype == torch.float32 else "tf32"
    overridden = any(x is not None for x in (block_m, tile_n, num_warps, num_stages))
    kv_fp8 = k_cache.element_size() == 1
    assert not kv_fp8 or kv_scales is not None, "an FP8 cache needs the layer's k/v scales"
    k_scale, v_scale = kv_scales if kv_fp8 else (seq_lens, seq_lens)  # type: ignore[misc]
    if rope is not None:
        assert max_query_len == 1 and not kv_fp8 and head_pad == head_size, "fused RoPE: decode, 16/32-bit cache"
        assert rope.cos_sin_cache.dtype == torch.float32 and rope.cos_sin_cache.shape[-1] == head_size
        knew = rope.key.reshape(rope.key.shape[0], -1)
        vnew = rope.value.reshape(rope.value.shape[0], -1)
        assert knew.stride(-1) == 1 and vnew.stride(-1) == 1
        rope_args = (rope.positions.reshape(-1), rope.cos_sin_cache, rope.cos_sin_cache.stride(0), knew, vnew,
                     knew.stride(0), vnew.stride(0), rope.slot_mapping)  # fmt: skip
    else:
        rope_args = (seq_lens, seq_lens, 0, seq_lens, seq_lens, 0, 0, seq_lens)  # (unread without ROPE)

    # Mixed batch with known decode count: decodes get the 16-row decode tiles, chunks the big prefill
    # tiles (one launch each; each skips the other's requests). Otherwise one launch for everything.
    if num_decodes is not None and 0 < num_decodes < num_reqs and max_query_len > 1 and not overridden:
        launches = [
            (launch_config(head_size, group, query.dtype, 1), 1),
            (launch_config(head_size, group, query.dtype, max_query_len), 2),
        ]
    else:
        cfg = launch_config(head_size, group, query.dtype, max_query_len)
        one_row_tile = envs.PAGEDLLM_ATTN_ONE_ROW_TILE_N
        if one_row_tile and num_reqs == 1 and max_query_len == 1 and not overridden:
            # One decoding request: its parallelism is the key segments' alone, and smaller key tiles make more.
            cfg = (cfg[0], one_row_tile, cfg[2], cfg[3])
        cfg = tuple(o or c for o, c in zip((block_m, tile_n, num_warps, num_stages), cfg))  # type: ignore[assignment]
        launches = [(cfg, 0)]

    if batch_invariant.enabled():
        # Batch-invariant mode: one tile shape for every step and no split-KV, so a query row meets its keys in
        # the same tiles, in the same order, alone or batched, decoded or inside a (chunked) prefill: key tiles
        # sit at absolute positions and a tile whose keys a row cannot see changes nothing of that row.
        launches = [(launch_config(head_size, group, query.dtype, 1), 0)]
        num_splits = 1

    if num_splits > 1:
        key = (num_actual_tokens, num_reqs, num_heads, num_kv_heads, num_splits, head_pad, query.device)
        bufs = workspace.get(key) if workspace is not None else None
        if bufs is None:
            n_part = num_actual_tokens * num_heads * num_splits
            bufs = (
                torch.empty(n_part * head_pad, dtype=torch.float32, device=query.device),
                torch.empty(n_part, dtype=torch.float32, device=query.device),
                torch.empty(n_part, dtype=torch.float32, device=query.device),
            )
            if workspace is not None:
                workspace[key] = bufs
        part_out, part_m, part_l = bufs
    else:
        part_out = part_m = part_l = output  # unused by the kernel
    if q8_twin is not None:
        assert writes_q8_twin(num_splits, head_size), "no q8 twin here: split-KV and whole groups of 32 a head"
        tq, td, ts = q8_twin
    else:
        tq = td = ts = output  # (unread without TWIN)
    counts = output
    if num_splits > 1:
        tiles = max(num_reqs if filt == 1 else num_actual_tokens + num_reqs for _, filt in launches)
        counts = _split_counts(tiles * num_kv_heads, query.device)
    # The merge takes a [heads, segments, head] tile of partials at a time: at most 8,192 values; the segments
    # all at once or `PAGEDLLM_ATTN_MERGE_CHUNK` at a time.
    chunk = envs.PAGEDLLM_ATTN_MERGE_CHUNK if num_splits > 1 else 0
    seg_chunk = min(num_splits, next_pow2(chunk)) if chunk > 0 else num_splits
    merge_heads = next_pow2(group)
    while merge_heads > 1 and merge_heads * seg_chunk * head_pad > 8192:
        merge_heads //= 2

    pdl = pdl_args(query, "attn")
    for (bm, tn, nw, ns), filt in launches:
        assert bm >= group and bm >= 16 and tn >= 16
        block_q = bm // group
        # Launches with decode tiles run one program per request (req = program id); otherwise programs are
        # numbered by token tiles (found by binary search) and the grid is an upper bound whose surplus exits
        # at once, which for a mixed step's decode launch over a 16k-token batch meant ~2k empty programs per
        # kv head (~80 us per layer on the H200). Chunk launches never go direct, so they compile to one
        # variant whatever the chunk lengths (the start-up warm-up compiles it on short chunks).
        direct = filt == 1 or (one_tile_rows(max_query_len, group) is not None and max_query_len <= block_q)
        num_q_tiles = num_reqs if direct else num_actual_tokens // block_q + num_reqs
        ordered = req_order is not None and direct and num_splits == 1
        if ordered and not overridden and not batch_invariant.enabled():
            tn = ordered_tile_n(tn, num_reqs * num_kv_heads, query.device)
        grid = (num_q_tiles * num_kv_heads, 1, 1) if ordered else (num_q_tiles, num_kv_heads, num_splits)
        # PDL decode launches read the step's lengths and first block ids before waiting (`EARLY`): only inputs
        # uploaded before the step (no request order, which a kernel of the step computes; no key limits).
        early_ok = direct and not ordered and key_limit is None and filt == 0
        use_early = early_ok and (bool(pdl) and envs.PAGEDLLM_ATTN_EARLY if early is None else early)
        kern._paged_attn_kernel[grid](
            output,
            query,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            query_start_loc,
            part_out,
            part_m,
            part_l,
            scale * _LOG2E,
            (logits_soft_cap or 0.0) * _LOG2E,
            num_reqs,
            num_heads,
            sliding_window if use_window else 0,
            query.stride(0),
            query.stride(1),
            output.stride(0),
            output.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_table.stride(0),
            k_scale,
            v_scale,
            key_limit if key_limit is not None else seq_lens,  # (unread without KEY_LIMIT)
            req_order if ordered else seq_lens,  # (unread without ORDERED)
            counts,
            tq,
            td,
            ts,
            tq.stride(0),
            td.stride(0),
            *rope_args,
            GROUP=group,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=k_cache.shape[1],
            BLOCK_M=bm,
            BLOCK_Q=block_q,
            TILE_N=tn,
            CAUSAL=causal,
            USE_WINDOW=use_window,
            NUM_SEGMENTS=num_splits,
            DOT_PREC=dot_prec,
            FILTER=filt,
            DIRECT=direct,
            SOFTCAP=bool(logits_soft_cap),
            KV_FP8=kv_fp8,
            FP8_F16=kv_fp8 and query.dtype != torch.float32 and envs.PAGEDLLM_FP8_ATTN_F16,
            KEY_LIMIT=key_limit is not None,
            ORDERED=ordered,
            MERGE_HEADS=merge_heads,
            SEG_CHUNK=seg_chunk,
            TWIN=q8_twin is not None,
            ROPE=rope is not None,
            EARLY=use_early,
            LATE_TRIGGER=use_early and envs.PAGEDLLM_ATTN_LATE_TRIGGER,
            num_warps=nw,
            num_stages=ns,
            **pdl,
        )
    return output


def writes_q8_twin(num_splits: int, head_size: int) -> bool:
    """Whether a launch can write o_proj's q8 twin: split-KV (the merge writes it), heads of whole groups of 32
    (a group never spans two heads), and `PAGEDLLM_ATTN_Q8_TWIN` on."""
    return envs.PAGEDLLM_ATTN_Q8_TWIN and num_splits > 1 and head_size % 32 == 0 and next_pow2(head_size) == head_size


_COUNTS: dict[torch.device, torch.Tensor] = {}


def _split_counts(n: int, device: torch.device) -> torch.Tensor:
    """Zeros for `n` (query tile, kv head) arrival counts of the split-KV merge, kept per device: each launch
    returns them to zero, so one buffer serves every launch, layer and CUDA-graph replay (grown, never
    shrunk). A CUDA-graph capture records a zeroing without running it, so the buffer must exist before: the
    start-up warm-up's split launches make it, with room for 4,096 counts (a split launch has fewer (request,
    kv head) pairs than the GPU has SMs)."""
    buf = _COUNTS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-KV counts for {n} tiles first needed inside a CUDA-graph capture")
        buf = torch.zeros(max(n, 4096, 2 * (buf.numel() if buf is not None else 0)), dtype=torch.int32, device=device)
        _COUNTS[device] = buf
    return buf
