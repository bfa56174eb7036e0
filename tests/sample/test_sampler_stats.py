"""Acceptance 1 (distributions): the sampler's empirical token distribution on a small fixed logits table
matches the exact target distribution, for temperature, min-p, top-k, top-p and their combinations.

Tests are deterministic (fixed seeds). Each case draws N = 100,000 tokens in one batched call and runs,
at alpha = 0.001, (a) a chi-square goodness-of-fit test over the tokens the target allows and (b) a
two-sided binomial z-test per token (Bonferroni: alpha / V each); tokens the target excludes must
never be drawn. Power: a 2-percentage-point absolute shift of any token's probability p moves its
z-statistic by 0.02 / sqrt(p (1 - p) / N) >= 12.6 standard errors (worst case p = 0.5), far beyond the
4.0 critical value plus 3.1 for 99.9 % power; `test_power_of_the_test` checks this and that the test
rejects a table shifted by 2 points.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, random_sample

ALPHA = 0.001
N = 100_000
SHIFT = 0.02
# Unsorted on purpose (index mapping through sorts must be right); no ties, no value on a cut boundary.
LOGITS = torch.tensor([0.6, 2.0, -1.4, 1.3, -0.3, 1.7, -4.0, 0.2, -2.9, 1.0, -0.8, -2.0], dtype=torch.float32)
V = LOGITS.numel()


def target_distribution(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """Reference, float64, written from the definitions (vLLM's order): temperature, min-p on the
    tempered probabilities, top-k, then top-p on what is left (the smallest most-likely set with mass
    >= top_p); renormalised."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.ones_like(p, dtype=bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    order = np.argsort(-p)
    if top_k > 0:
        keep[order[top_k:]] = False
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        mass_before = 0.0
        for i in np.argsort(-q):
            if q[i] == 0.0:
                break
            if mass_before >= top_p:
                keep[i] = False
            mass_before += q[i]
        q = np.where(keep, q, 0.0)
        q /= q.sum()
    return q


def metadata(n: int, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.full((n,), temperature),
        top_p=torch.full((n,), top_p) if top_p < 1.0 else None,
        top_k=torch.full((n,), top_k, dtype=torch.int64) if top_k > 0 else None,
        min_p=torch.full((n,), min_p) if min_p > 0 else None,
        all_greedy=False,
        all_random=True,
    )


def chi2_sf(x: float, df: int) -> float:
    a, b = torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, b))


def normal_two_sided_p(z: float) -> float:
    return math.erfc(abs(z) / math.sqrt(2))


def check_matches(counts: np.ndarray, target: np.ndarray, n: int) -> None:
    excluded = target == 0
    assert counts[excluded].sum() == 0, f"excluded tokens drawn: {np.nonzero(counts * excluded)[0]}"
    allowed = ~excluded
    exp = target[allowed] * n
    chi2 = float(((counts[allowed] - exp) ** 2 / exp).sum())
    df = int(allowed.sum()) - 1
    if df > 0:
        p = chi2_sf(chi2, df)
        assert p > ALPHA, f"chi-square GOF rejected: chi2={chi2:.1f}, df={df}, p={p:.2e}"
    for i in np.nonzero(allowed)[0]:
        if target[i] >= 1.0:
            continue
        se = math.sqrt(target[i] * (1 - target[i]) / n)
        z = (counts[i] / n - target[i]) / se
        p = normal_two_sided_p(z)
        assert p > ALPHA / V, f"token {i}: empirical {counts[i] / n:.4f} vs target {target[i]:.4f} (z={z:.2f})"


def draw(md: SamplingMetadata, n: int, seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    out = Sampler()(LOGITS.expand(n, V).clone(), md).sampled_token_ids
    return np.bincount(out.numpy(), minlength=V)


CASES = [
    ("temperature_1", dict(temperature=1.0)),
    ("temperature_0.5", dict(temperature=0.5)),
    ("temperature_1.7", dict(temperature=1.7)),
    ("top_k_4", dict(temperature=1.0, top_k=4)),
    ("top_p_0.8", dict(temperature=1.0, top_p=0.8)),
    ("min_p_0.1", dict(temperature=1.0, min_p=0.1)),
    ("temp_0.8_top_k_6_top_p_0.9", dict(temperature=0.8, top_k=6, top_p=0.9)),
    ("temp_1.3_min_p_0.05_top_p_0.85", dict(temperature=1.3, min_p=0.05, top_p=0.85)),
    ("temp_0.7_min_p_0.02_top_k_5", dict(temperature=0.7, min_p=0.02, top_k=5)),
    ("all_four", dict(temperature=1.2, min_p=0.03, top_k=7, top_p=0.75)),
]


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_distribution_matches_target(name: str, kw: dict) -> None:
    target = target_distribution(LOGITS.numpy(), **kw)
    counts = draw(metadata(N, **kw), N, seed=1234)
    check_matches(counts, target, N)


def test_mixed_rows_each_follow_their_own_target() -> None:
    """Rows with different settings in one batch: each row's parameters apply to that row only."""
    settings = [dict(temperature=1.0), dict(temperature=0.6, top_k=3), dict(temperature=1.1, top_p=0.7, min_p=0.05)]
    per = 40_000
    n = per * len(settings)
    md = SamplingMetadata(
        temperature=torch.tensor([s["temperature"] for s in settings]).repeat_interleave(per),
        top_p=torch.tensor([s.get("top_p", 1.0) for s in settings]).repeat_interleave(per),
        top_k=torch.tensor([s.get("top_k", 0) for s in settings], dtype=torch.int64).repeat_interleave(per),
        min_p=torch.tensor([s.get("min_p", 0.0) for s in settings]).repeat_interleave(per),
        all_greedy=False,
        all_random=True,
    )
    torch.manual_seed(99)
    out = Sampler()(LOGITS.expand(n, V).clone(), md).sampled_token_ids.numpy()
    for j, s in enumerate(settings):
        counts = np.bincount(out[j * per : (j + 1) * per], minlength=V)
        check_matches(counts, target_distribution(LOGITS.numpy(), **s), per)


def test_seeded_generators_follow_the_target() -> None:
    """The per-row generator path (seeded requests) samples the same distribution."""
    rows, steps = 500, 100
    gens = {i: torch.Generator().manual_seed(1000 + i) for i in range(rows)}
    probs = torch.softmax(LOGITS / 0.9, dim=-1).expand(rows, V)
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(steps):
        counts += np.bincount(random_sample(probs.clone(), gens).numpy(), minlength=V)
    check_matches(counts, target_distribution(LOGITS.numpy(), 0.9), rows * steps)


def test_power_of_the_test() -> None:
    """The test design detects a 2-point shift: analytically for every token of every case, and
    empirically on a draw from a table shifted by 2 points."""
    z_crit = -torch.special.ndtri(torch.tensor(ALPHA / V / 2, dtype=torch.float64)).item()
    z_power = 3.09  # 99.9 % power
    for _, kw in CASES:
        t = target_distribution(LOGITS.numpy(), **kw)
        for p in t[t > 0]:
            se = math.sqrt(max(p * (1 - p), (p + SHIFT) * (1 - p - SHIFT), 1e-12) / N)
            assert SHIFT / se > z_crit + z_power
    # A draw from the true table, tested against a table with 2 points moved between two tokens, fails.
    target = target_distribution(LOGITS.numpy(), 1.0)
    counts = draw(metadata(N, 1.0), N, seed=7)
    shifted = target.copy()
    shifted[1] -= SHIFT
    shifted[3] += SHIFT
    with pytest.raises(AssertionError):
        check_matches(counts, shifted, N)
