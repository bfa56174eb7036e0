"""The n-gram (prompt-lookup) proposer on the device, for speculation with async scheduling: the next step's
proposals come from tokens that are only on the device when the step is launched (the one verified before
it), so they are found there, without a copy to the host. Same rule as `ngram.ngram_propose`: the longest
suffix of the context (prompt_lookup_min..prompt_lookup_max tokens) that occurred earlier proposes the
tokens after its most recent earlier occurrence.

Each request's tokens live in one row of a [slots, width] history; its length is on the device too. The
search compares every earlier end position with the suffix at once (prompt_lookup_max masked compares over
the rows' first `bound` columns): no loop over the context, no host sync."""

from __future__ import annotations

import torch


def ngram_propose_device(
    hist: torch.Tensor, lens: torch.Tensor, n_min: int, n_max: int, k: int, bound: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """hist [B, W] the requests' tokens (the first lens[b] known), bound >= max(lens) (a host upper bound,
    <= W). Returns (proposals [B, k], the number of real ones [B]); proposals past the real ones repeat the
    last token (any token keeps the verification exact: a proposal is only kept if the target agrees)."""
    b = hist.shape[0]
    dev = hist.device
    ctx = hist[:, :bound].long()
    lens = lens.long()
    pos = torch.arange(bound, device=dev)
    last = (lens - 1).clamp(min=0)
    # match[b, e]: how many tokens ending at e equal the context's suffix (consecutively, up to n_max).
    match = torch.zeros(b, bound, dtype=torch.long, device=dev)
    alive = (pos.unsqueeze(0) < last.unsqueeze(1)) & (lens.unsqueeze(1) > n_min)  # earlier ends: e <= len - 2
    for j in range(n_max):
        suffix_tok = ctx.gather(1, (last - j).clamp(min=0).unsqueeze(1))  # [B, 1]
        src = pos - j
        shifted = ctx[:, src.clamp(min=0)]
        ok = alive & (src >= 0).unsqueeze(0) & (shifted == suffix_tok) & (last - j >= 0).unsqueeze(1)
        match += ok
        alive = ok
    # The longest match of at least n_min tokens, the most recent among equals.
    key = torch.where(match >= n_min, match * (bound + 1) + pos.unsqueeze(0), torch.full_like(match, -1))
    best = key.max(dim=1).values
    found = best >= 0
    end = torch.where(found, best % (bound + 1), last)
    idx = end.unsqueeze(1) + 1 + torch.arange(k, device=dev).unsqueeze(0)
    real = found.unsqueeze(1) & (idx < lens.unsqueeze(1))
    last_tok = ctx.gather(1, last.unsqueeze(1))
    props = torch.where(real, ctx.gather(1, idx.clamp(max=bound - 1)), last_tok)
    return props, real.sum(dim=1)
