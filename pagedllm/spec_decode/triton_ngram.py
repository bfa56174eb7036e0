"""The device side of n-gram speculation under async scheduling as two Triton kernels, one program per request
(the same work as `async_ngram.fixup_graph_inputs`, `rejection_sampler.greedy_verify` and
`DeviceHistory.append_and_propose` in PyTorch, which took ~150 small launches a step: the host time of a step
then exceeded SmolLM2's whole step on the device, NOTES session 21).

- `fixup_graph_inputs`: a verification graph's input ids, positions, sequence lengths and KV slots from each
  request's length on the device (one launch per KV-cache group).
- `verify_append_propose`: the greedy verdict of each request's proposals against its rows' argmax (or the
  tokens a rejection sampler emitted), the emitted tokens appended to its history, and its next proposals:
  the longest suffix (prompt_lookup_min..max tokens) of the new history that occurred before, the most recent
  such occurrence, its following tokens (`ngram.ngram_propose`'s rule).
"""

from __future__ import annotations

import torch

from pagedllm.triton_utils import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

_BLOCK = 256

if HAS_TRITON:

    @triton.jit
    def _fixup_kernel(slots_ptr, nd_ptr, lens_ptr, hist_ptr, stride_h, drafts_ptr, stride_d, bt_ptr, stride_bt,
                      ids_ptr, pos_ptr, seq_ptr, slot_out_ptr, max_len,
                      Q: tl.constexpr, QP: tl.constexpr, BS: tl.constexpr, WRITE_IDS: tl.constexpr):  # fmt: skip
        i = tl.program_id(0)
        s = tl.load(slots_ptr + i)
        nd = tl.load(nd_ptr + i)
        base = tl.maximum(tl.load(lens_ptr + s) - 1, 0)
        j = tl.arange(0, QP)
        row = (j < Q) & (nd + j * 0 >= 0)  # (nd -1: a padded request of a fused graph, whose inputs the host set)
        p = base + j
        if WRITE_IDS:
            last = tl.load(hist_ptr + s * stride_h + base).to(tl.int64)
            d = tl.load(drafts_ptr + s * stride_d + j - 1, mask=row & (j > 0), other=0)
            tl.store(ids_ptr + i * Q + j, tl.where(j == 0, last, d), mask=row)
            tl.store(pos_ptr + i * Q + j, p, mask=row)
            tl.store(seq_ptr + i + j, (base + Q).to(tl.int32), mask=row & (j == 0))
        valid = (j <= nd) & (p < max_len)
        pc = tl.minimum(p, max_len - 1)
        blk = tl.load(bt_ptr + i * stride_bt + pc // BS, mask=row, other=0).to(tl.int64)
        tl.store(slot_out_ptr + i * Q + j, tl.where(valid, blk * BS + pc % BS, -1), mask=row)

    @triton.jit
    def _verify_append_propose_kernel(
        am_ptr, starts_ptr, nd_ptr, slots_ptr, tok_in_ptr, cnt_in_ptr,
        hist_ptr, stride_h, lens_ptr, drafts_ptr, stride_d, real_ptr,
        tok_out_ptr, cnt_out_ptr, real_out_ptr, width,
        K: tl.constexpr, KP: tl.constexpr, N_MIN: tl.constexpr, N_MAX: tl.constexpr, NMP: tl.constexpr,
        FROM_ARGMAX: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        s = tl.load(slots_ptr + b)
        nd = tl.load(nd_ptr + b)
        h = hist_ptr + s * stride_h
        # (Clamped: past max_model_len (= width - 2 (K + 1)) a request has finished, and the writes below stay
        # inside its row.)
        length = tl.minimum(tl.load(lens_ptr + s), width - 2 * (K + 1))
        j = tl.arange(0, KP)
        col = j < K + 1
        on = (nd >= 0).to(tl.int64)  # 0: a padded request of a fused graph (nd -1): its history is left as is
        live = j * 0 + on > 0  # (a vector: the interpreter takes no 0-d mask)
        nd = tl.maximum(nd, 0)
        if FROM_ARGMAX:  # greedy: proposals kept while they equal their row's argmax, then that row's argmax
            st = tl.load(starts_ptr + b)
            tgt = tl.load(am_ptr + st + tl.minimum(j, nd), mask=col, other=0)
            dr = tl.load(drafts_ptr + s * stride_d + j, mask=(j < nd) & (j < K), other=-2)
            miss = (tgt != dr) | (j >= nd)
            acc = tl.min(tl.where(miss, j, KP), axis=0)
            tok = tl.where(j <= acc, tgt, -1)
            tl.store(tok_out_ptr + b * (K + 1) + j, tok, mask=col)
            cnt = acc + 1
        else:
            tok = tl.load(tok_in_ptr + b * (K + 1) + j, mask=col, other=-1)
            cnt = tl.load(cnt_in_ptr + b)
        tl.store(cnt_out_ptr + b, cnt)
        tl.store(real_out_ptr + b, tl.minimum(tl.load(real_ptr + s), nd))
        tl.store(h + length + j, tok.to(tl.int32), mask=(j < cnt) & live)
        length = length + cnt * on
        tl.store(lens_ptr + s + j, length, mask=live & (j == 0))
        tl.debug_barrier()  # the appended tokens are visible to the search below
        # match[e]: how many tokens ending at e equal the history's suffix, consecutively (up to N_MAX), for
        # every earlier end e <= length - 2; the key orders by match length, then recency.
        offs = tl.arange(0, BLOCK)
        jv = tl.arange(0, NMP)
        sufv = tl.load(h + length - 1 - jv, mask=(jv < N_MAX) & (length - 1 - jv >= 0), other=-1)
        best = tl.full([BLOCK], -1, dtype=tl.int64)
        hi = tl.where(length > N_MIN, length - 1, 0) * on  # (a history of at most N_MIN tokens proposes nothing)
        for e0 in range(0, hi, BLOCK):
            e = e0 + offs
            alive = e < hi
            m = tl.zeros([BLOCK], dtype=tl.int64)
            for jj in tl.static_range(N_MAX):
                suf = tl.sum(tl.where(jv == jj, sufv, 0), axis=0)  # the suffix's token jj from its end (-1: none)
                v = tl.load(h + e - jj, mask=alive & (e - jj >= 0), other=-2)
                alive = alive & (e - jj >= 0) & (v == suf)
                m += alive.to(tl.int64)
            key = tl.where(m >= N_MIN, m * (width + 1) + e, -1)
            best = tl.maximum(best, key)
        top = tl.max(best, axis=0)
        last_tok = tl.load(h + tl.maximum(length - 1, 0))  # (a padded request's slot may hold no tokens)
        end = tl.where(top >= 0, top % (width + 1), length)  # (no match: every index past the history)
        idx = end + 1 + j
        real = (idx < length) & (j < K)
        prop = tl.load(h + idx, mask=real, other=0)
        prop = tl.where(real, prop, last_tok)
        tl.store(drafts_ptr + s * stride_d + j, prop.to(tl.int64), mask=(j < K) & live)
        tl.store(real_ptr + s + j, tl.sum(real.to(tl.int64), axis=0), mask=live & (j == 0))


def fixup_graph_inputs(
    graphs: object,
    history: object,
    slots: torch.Tensor,
    num_drafts: torch.Tensor,
    block_sizes: list[int],
    max_model_len: int,
) -> None:
    """`async_ngram.fixup_graph_inputs` in one launch per KV-cache group."""
    g, h = graphs, history  # worker.cuda_graph.CudaGraphRunner, async_ngram.DeviceHistory
    n, q = int(slots.shape[0]), g.q  # type: ignore[attr-defined]
    for gi, (table, sl, bs) in enumerate(zip(g.block_tables, g.slots, block_sizes)):  # type: ignore[attr-defined]
        _fixup_kernel[(n,)](
            slots, num_drafts, h.lens, h.hist, h.hist.stride(0), h.drafts, h.drafts.stride(0),  # type: ignore[attr-defined]
            table, table.stride(0), g.input_ids, g.positions, g.seq_lens, sl, max_model_len,  # type: ignore[attr-defined]
            Q=q, QP=triton.next_power_of_2(q), BS=bs, WRITE_IDS=gi == 0, num_warps=1,
        )  # fmt: skip


def verify_append_propose(
    history: object,
    slots: torch.Tensor,
    num_drafts: torch.Tensor,
    starts: torch.Tensor | None,
    argmax: torch.Tensor | None,
    tokens: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per request b (history slot slots[b], num_drafts[b] proposal rows from row starts[b] of `argmax`): the
    emitted tokens [B, K + 1] (-1 after the last), their count, and how many of the verified proposals were
    real; the history grows by the emitted tokens and holds the next proposals. With `tokens` / `counts`
    (a rejection sampler's output) instead of `argmax`, only the append and the proposals."""
    h = history  # async_ngram.DeviceHistory
    k = h.k  # type: ignore[attr-defined]
    b = int(slots.shape[0])
    dev = slots.device
    from_argmax = argmax is not None
    tok_out = torch.empty(b, k + 1, dtype=torch.int64, device=dev) if from_argmax else tokens
    cnt_out = torch.empty(b, dtype=torch.int64, device=dev)
    real_out = torch.empty(b, dtype=torch.int64, device=dev)
    assert tok_out is not None
    dummy = cnt_out
    _verify_append_propose_kernel[(b,)](
        argmax if from_argmax else dummy, starts if starts is not None else dummy, num_drafts, slots,
        tokens if tokens is not None else dummy, counts if counts is not None else dummy,
        h.hist, h.hist.stride(0), h.lens, h.drafts, h.drafts.stride(0), h.num_real,  # type: ignore[attr-defined]
        tok_out, cnt_out, real_out, h.width,  # type: ignore[attr-defined]
        K=k, KP=triton.next_power_of_2(k + 1), N_MIN=h.n_min, N_MAX=h.n_max,  # type: ignore[attr-defined]
        NMP=triton.next_power_of_2(h.n_max),  # type: ignore[attr-defined]
        FROM_ARGMAX=from_argmax, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    return tok_out, cnt_out, real_out
