"""Top-k / top-p filtering of a batch of logits rows, each row with its own k and p (rows that use neither
are left alone), by the cheapest of three exact methods for the batch's parameters."""

from __future__ import annotations

import numpy as np
import torch


def apply_top_k_top_p(
    logits: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    k_host: np.ndarray | None = None,
    p_host: np.ndarray | None = None,
) -> torch.Tensor:
    """top-k (0 = off) then top-p over what is left (the smallest most-likely set whose mass reaches p).

    Only rows that use them pay: rows with top-p get their nucleus (their top-k applied first), rows with
    top-k alone a threshold from one topk (k = their largest), other rows are untouched. `k_host` /
    `p_host` are host copies of k / p (the metadata carries them): which rows use what, and the largest k,
    are then decided on the host, so a CUDA step never waits on the device here. On CUDA the nucleus
    comes from one sort of the rows (no data-dependent host decisions); on the CPU from growing topk
    candidates, which is cheaper there than sorting the vocabulary.
    """
    vocab = logits.shape[-1]
    n = logits.shape[0]
    dev = logits.device
    if k is not None and k_host is None:
        k_host = k.cpu().numpy()
    if p is not None and p_host is None:
        p_host = p.cpu().numpy()
    p_mask = (p_host < 1.0) if p_host is not None else np.zeros(n, dtype=bool)
    k_mask = ((k_host > 0) & ~p_mask) if k_host is not None else np.zeros(n, dtype=bool)

    def rows_of(mask: np.ndarray) -> torch.Tensor | None:  # None: every row
        return None if mask.all() else torch.from_numpy(np.nonzero(mask)[0]).to(dev, non_blocking=True)

    if k_mask.any():
        assert k is not None and k_host is not None
        rows = rows_of(k_mask)
        sub = logits if rows is None else logits[rows]
        kk: torch.Tensor | None = (k if rows is None else k[rows]).clamp(max=vocab)
        assert kk is not None
        kmax = int(min(vocab, k_host[k_mask].max()))
        thresh = sub.topk(kmax, dim=-1).values.gather(1, (kk - 1).unsqueeze(1))
        sub = sub.masked_fill(sub < thresh, -float("inf"))
        if rows is None:
            logits = sub
        else:
            logits[rows] = sub
    if p_mask.any():
        assert p is not None
        if logits.is_cuda:
            # Rows whose top-k is small find their nucleus among their top k (one topk, no sort); the
            # others sort their row. Both without a host decision that reads the device.
            small = p_mask & (k_host > 0) & (k_host <= vocab // 8) if k_host is not None else np.zeros(n, bool)
            for mask, by_topk in ((small, True), (p_mask & ~small, False)):
                if not mask.any():
                    continue
                rows = rows_of(mask)
                sub = logits if rows is None else logits[rows]
                kk = None if k is None else (k if rows is None else k[rows])
                pp = p if rows is None else p[rows]
                if by_topk:
                    assert kk is not None and k_host is not None
                    sub = _top_k_top_p_by_topk(sub, kk, pp, int(k_host[mask].max()))
                else:
                    sub = _sorted_top_k_top_p(sub, kk, pp)
                if rows is None:
                    logits = sub
                else:
                    logits[rows] = sub
            return logits
        rows = rows_of(p_mask)
        sub = logits if rows is None else logits[rows]
        kk = None if k is None else (k if rows is None else k[rows])
        pp = p if rows is None else p[rows]
        kk_host = None if k_host is None else k_host[p_mask]
        sub = _top_p_by_candidates(sub, kk, pp, kk_host)
        if rows is None:
            logits = sub
        else:
            logits[rows] = sub
    return logits


def _top_k_top_p_by_topk(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, kmax: int) -> torch.Tensor:
    """top-k then top-p for rows that all have 0 < k <= kmax: the nucleus of the renormalised top-k
    distribution lies among the top k, so one topk(kmax) decides it (the descending "mass before < p"
    rule, as `_top_p_by_candidates`)."""
    vals = logits.topk(kmax, dim=-1).values  # descending
    col = torch.arange(kmax, device=logits.device)
    vals = vals.masked_fill(col[None, :] >= k[:, None], -float("inf"))  # each row's own k
    probs = vals.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    keep = mass_before < p.unsqueeze(1)
    keep[:, 0] = True
    keep &= col[None, :] < k[:, None]
    thresh = vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    return logits.masked_fill(logits < thresh, -float("inf"))


_TOP_P_FIRST_CANDIDATES = 256


def _top_p_by_candidates(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor, k_host: np.ndarray | None = None
) -> torch.Tensor:
    """top-k then top-p without sorting the vocabulary: the nucleus is found among the top K candidates
    (one topk; K doubles while some row's nucleus may extend past them), normalised by the full
    logsumexp. A row is decided once the mass above its last candidate reaches p: every token outside
    is smaller, so it is out. Rows still undecided at K >= vocab / 8 take the full sort."""
    vocab = logits.shape[-1]
    if k is not None:
        # (rows without top-k must not make this a topk over the whole vocabulary)
        logits = apply_top_k_top_p(logits, k, None, k_host)
    lse = logits.logsumexp(dim=-1, keepdim=True)
    todo: torch.Tensor | None = None  # rows still undecided (None: all rows, no gather needed)
    cand = _TOP_P_FIRST_CANDIDATES
    while True:
        sub = logits if todo is None else logits[todo]
        pp = p if todo is None else p[todo]
        if cand >= vocab // 8:
            res = _sorted_top_k_top_p(sub, None, pp)
            if todo is None:
                return res
            logits[todo] = res
            return logits
        vals = sub.topk(cand, dim=-1).values  # descending
        probs = (vals - (lse if todo is None else lse[todo])).exp_()
        mass_before = probs.cumsum(dim=-1).sub_(probs)
        keep = mass_before < pp.unsqueeze(1)
        keep[:, 0] = True
        decided = ~keep[:, -1]
        thresh = vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
        if bool(decided.all()):
            sub.masked_fill_(sub < thresh, -float("inf"))
            if todo is None:
                return sub
            logits[todo] = sub
            return logits
        if bool(decided.any()):
            idx = decided.nonzero().squeeze(1)
            d = sub[idx]
            d.masked_fill_(d < thresh[idx], -float("inf"))
            logits[idx if todo is None else todo[idx]] = d
        undecided = (~decided).nonzero().squeeze(1)
        todo = undecided if todo is None else todo[undecided]
        cand *= 4


def _sorted_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        k_eff = torch.where(k <= 0, torch.full_like(k, vocab), k).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k_eff).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -float("inf"))
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    # Ascending order: drop the low tail whose cumulative mass is <= 1 - p; always keep the top token.
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)
