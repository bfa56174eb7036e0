"""N-gram (prompt-lookup) proposer: the longest suffix of a request's tokens (between prompt_lookup_min
and prompt_lookup_max tokens) that occurred earlier in its own tokens proposes the tokens that followed
its most recent earlier occurrence. Vectorized over the context: one comparison of the whole context
with the last token, then at most prompt_lookup_max - 1 gathers over the candidate positions."""

from __future__ import annotations

import numpy as np


def ngram_propose(ctx: np.ndarray, n_min: int, n_max: int, k: int) -> np.ndarray:
    """Up to `k` proposed tokens for the tokens `ctx` (empty: no n-gram of length >= n_min recurs)."""
    n = len(ctx)
    if n <= n_min or k <= 0:
        return ctx[:0]
    last = ctx[-1]
    cand = np.flatnonzero(ctx[:-1] == last)  # ends of earlier occurrences of the last token
    if not len(cand):
        return ctx[:0]
    # match[c]: how many tokens before and including cand[c] equal the suffix (up to n_max).
    match = np.ones(len(cand), dtype=np.int64)
    alive = np.ones(len(cand), dtype=bool)
    for j in range(1, n_max):
        idx = cand - j
        ok = alive & (idx >= 0)
        ok[ok] = ctx[idx[ok]] == ctx[n - 1 - j]
        match += ok
        alive = ok
        if not alive.any():
            break
    best = int(match.max())
    if best < n_min:
        return ctx[:0]
    end = int(cand[np.flatnonzero(match == best)[-1]])  # the most recent of the longest matches
    return ctx[end + 1 : end + 1 + k]


class NgramProposer:
    def __init__(self, n_min: int, n_max: int, k: int) -> None:
        self.n_min, self.n_max, self.k = n_min, n_max, k

    def propose(
        self, req_ids: list[str], token_ids: np.ndarray, rows: list[int], num_tokens: np.ndarray, caps: list[int]
    ) -> list[list[int]]:
        """Per row, proposals over its first num_tokens[row] tokens, at most caps[i] of them."""
        return [
            ngram_propose(token_ids[row, : int(num_tokens[row])], self.n_min, self.n_max, min(self.k, cap)).tolist()
            for row, cap in zip(rows, caps)
        ]
