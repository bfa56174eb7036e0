"""Acceptance 2: the rejection sampler's output distribution equals the target's.

Fixed target distributions over an 8-token vocabulary, a different one per position (p1, p2 after two
proposals, p3 for the bonus), proposals drawn from a fixed draft distribution q (or, n-gram style, a fixed
deterministic proposal), 100,000 requests verified at once. For each position j, the tokens emitted at j
(by requests that emitted at least j tokens) must follow p_j: a chi-square goodness-of-fit test at
alpha = 0.001 per test (seeds are fixed, so the verdicts are deterministic), at temperature 1 and with
top-k / top-p applied to the target logits. Tokens outside p_j's support must never appear. The same
harness rejects a deliberately wrong sampler (the rejection rule told the wrong draft probabilities)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.sample.rejection_sampler import rejection_sample
from pagedllm.sample.top_k_top_p import apply_top_k_top_p

ALPHA = 1e-3
N = 100_000
V = 8
K = 2


def chisquare_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square goodness-of-fit p-value: the chi2(df = bins - 1) survival function, which is
    the regularized upper incomplete gamma Q(df / 2, stat / 2)."""
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K + 1, V, generator=g) * 1.5


def _expected(logits: torch.Tensor, top_k: int, top_p: float) -> np.ndarray:
    """The target distribution written out by hand: softmax, the top_k most likely, then the smallest
    most-likely set whose mass reaches top_p, renormalized."""
    p = torch.softmax(logits.double(), dim=-1).numpy()
    order = np.argsort(-p, kind="stable")
    keep = order[:top_k] if top_k > 0 else order
    pk = p[keep] / p[keep].sum()
    if top_p < 1.0:
        n = int(np.searchsorted(np.cumsum(pk), top_p) + 1)
        keep = keep[:n]
    out = np.zeros(V)
    out[keep] = p[keep] / p[keep].sum()
    return out


def _run(top_k: int, top_p: float, point_proposal: bool, claimed_q: torch.Tensor | None = None) -> tuple:
    torch.manual_seed(1234)
    logits = _logits(7)
    rows = logits.repeat(N, 1)  # request b's rows: b*(K+1) .. b*(K+1)+K
    if top_k or top_p < 1.0:
        kt = torch.full((len(rows),), top_k, dtype=torch.int64) if top_k else None
        pt = torch.full((len(rows),), top_p) if top_p < 1.0 else None
        rows = apply_top_k_top_p(rows, kt, pt)
    q = torch.softmax(_logits(99)[:K] * 0.7, dim=-1)  # the draft's distribution per proposal position
    if point_proposal:  # n-gram style: always the same proposals (the likeliest), no draft probabilities
        drafts = logits[:K].argmax(dim=-1).repeat(N)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True) for j in range(K)], dim=1).reshape(-1)
        draft_probs = q.repeat(N, 1)
    if claimed_q is not None:
        draft_probs = claimed_q.repeat(N, 1)
    out = rejection_sample(
        rows.argmax(dim=-1),
        rows,
        torch.zeros(N, dtype=torch.bool),
        drafts,
        np.full(N, K, dtype=np.int64),
        draft_probs,
    )
    expected = [_expected(logits[j], top_k, top_p) for j in range(K + 1)]
    return out, expected


def _pvalues(out, expected) -> list[float]:  # noqa: ANN001
    tok, n = out.token_ids.numpy(), out.num_emitted.numpy()
    pvals = []
    for j in range(K + 1):
        x = tok[n > j, j]
        counts = np.bincount(x, minlength=V)
        support = expected[j] > 0
        assert counts[~support].sum() == 0, f"position {j}: tokens outside the target's support"
        pvals.append(chisquare_pvalue(counts[support], expected[j][support] * len(x)))
    return pvals


@pytest.mark.parametrize("point_proposal", [False, True], ids=["draft_probs", "point_proposal"])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.8), (6, 0.9)])
def test_rejection_sampler_matches_target(top_k: int, top_p: float, point_proposal: bool) -> None:
    out, expected = _run(top_k, top_p, point_proposal)
    n = out.num_emitted.numpy()
    assert (n >= 1).all() and (n <= K + 1).all()
    assert (n == K + 1).sum() > 1000, "too few requests reached the bonus token for the test to mean anything"
    pvals = _pvalues(out, expected)
    assert min(pvals) > ALPHA, f"chi-square p-values {pvals} (alpha {ALPHA})"


def test_wrong_sampler_is_rejected() -> None:
    """Proposals drawn from q but verified as if drawn from the uniform distribution: the emitted
    distribution is no longer the target's, and the chi-square test says so."""
    out, expected = _run(0, 1.0, False, claimed_q=torch.full((K, V), 1.0 / V))
    assert min(_pvalues(out, expected)) < ALPHA


def test_chisquare_pvalue_known_values() -> None:
    # chi2 with 1 df: P(X > 3.841) = 0.05; with 4 df: P(X > 13.277) = 0.01 (statistics tables).
    assert (
        abs(chisquare_pvalue(np.array([1.0 + np.sqrt(3.841 / 2), 1 - np.sqrt(3.841 / 2)]), np.array([1.0, 1.0])) - 0.05)
        < 1e-3
    )
    c = np.array([10 + np.sqrt(13.277 * 10), 10, 10, 10, 10.0])
    assert abs(chisquare_pvalue(c, np.full(5, 10.0)) - 0.01) < 1e-3


def test_greedy_rows_are_the_exact_special_case() -> None:
    """Greedy requests keep proposals while they equal the argmax and then emit the argmax; random and
    greedy requests mix in one call."""
    logits = torch.tensor([[0.0, 5, 1], [4, 0, 1], [0, 0, 9], [1, 2, 0], [3, 1, 0], [0, 0, 0.5]])
    # request 0 (greedy, 2 proposals [1, 0]): both accepted, bonus argmax 2; request 1 (greedy, 1 proposal [2]):
    # rejected at once, emits argmax 1; request 2 (greedy, no proposal): emits argmax 2.
    out = rejection_sample(
        logits.argmax(dim=-1),
        logits,
        torch.tensor([True, True, True]),
        torch.tensor([1, 0, 2]),
        np.array([2, 1, 0]),
    )
    assert out.num_emitted.tolist() == [3, 1, 1]
    assert out.token_ids.tolist() == [[1, 0, 2], [1, -1, -1], [2, -1, -1]]
