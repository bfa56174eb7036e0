"""The verification sampler of speculative decoding: rejection sampling (Leviathan et al. 2023, Chen et al.
2023) over every request's proposed tokens at once, so that the emitted tokens are distributed exactly as
the target model's sampling distribution (after temperature, min_p, top-k / top-p and the logits
processors); greedy requests are its exact special case (a proposal is kept iff it is the argmax).

Layout: request b proposes k_b tokens d_b1..d_bk and has k_b + 1 target rows (the distributions after its
last known token and after each proposal). Proposal j is kept with probability min(1, p_j(d_j) / q_j(d_j));
at the first rejection the request emits a token from norm(max(p_j - q_j, 0)) and stops; with every
proposal kept it emits a bonus token from p_{k+1}. Proposals without draft probabilities (n-gram: a
deterministic proposal) have q = one-hot(d)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sample import triton_argmax
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import _EPS, Sampler, random_sample
from pagedllm.sample.top_k_top_p import apply_top_k_top_p


@dataclass
class VerifyOutput:
    token_ids: torch.Tensor
    """[B, K + 1] the emitted tokens of each request, -1 after its last."""
    num_emitted: torch.Tensor
    """[B] tokens emitted per request (accepted proposals + 1)."""
    token_rows: torch.Tensor
    """[B, K + 1] the target row each emitted token was sampled at (padding: the request's last row)."""


def target_logits(sampler: Sampler, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy argmax per row, the logits random rows sample from): the same processing as
    `Sampler.sample` (logits processors and penalties, temperature, min_p, top-k / top-p)."""
    logits = sampler.apply_logits_processors(logits.float(), md)
    greedy = triton_argmax.argmax_rows(logits)
    temp = torch.where(md.temperature < _EPS, torch.ones_like(md.temperature), md.temperature)
    logits = logits / temp.unsqueeze(1)
    for proc in sampler.argmax_invariant:
        logits = proc.apply(logits, md)
    if md.top_k is not None or md.top_p is not None:
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p, md.top_k_host, md.top_p_host)
    return greedy, logits


def rejection_sample(
    greedy_ids: torch.Tensor,
    processed_logits: torch.Tensor,
    is_greedy: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: np.ndarray,
    draft_probs: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> VerifyOutput:
    """Verify the proposals of B requests.

    greedy_ids [R], processed_logits [R, V]: per target row (R = sum(num_draft + 1), request by request);
    is_greedy [B] bool; draft_token_ids [D] (D = sum(num_draft)); draft_probs [D, V] or None (one-hot);
    generators: request index -> its generator (seeded requests draw their uniforms and noise from it)."""
    dev = processed_logits.device
    b = len(num_draft)
    k_max = int(num_draft.max(initial=0))
    n_rows = num_draft + 1
    starts = np.zeros(b, dtype=np.int64)
    np.cumsum(n_rows[:-1], out=starts[1:])
    d_starts = starts - np.arange(b)  # each request's first draft index
    d = int(num_draft.sum())
    draft_req = np.repeat(np.arange(b), num_draft)
    draft_pos = np.arange(d) - d_starts[draft_req]
    target_row = torch.from_numpy(starts[draft_req] + draft_pos).to(dev)
    draft_ids = draft_token_ids.to(dev)

    probs = processed_logits.softmax(dim=-1)
    # Acceptance per proposal.
    p_d = probs[target_row].gather(1, draft_ids.view(-1, 1)).squeeze(1) if d else probs.new_zeros(0)
    q_d = draft_probs.gather(1, draft_ids.view(-1, 1)).squeeze(1) if draft_probs is not None else torch.ones_like(p_d)
    u = torch.rand(d, device=dev)
    for i, gen in (generators or {}).items():
        lo = int(d_starts[i])
        if num_draft[i]:
            u[lo : lo + int(num_draft[i])] = torch.rand(int(num_draft[i]), device=dev, generator=gen)
    greedy_d = is_greedy[torch.from_numpy(draft_req).to(dev)] if d else is_greedy.new_zeros(0)
    accept = torch.where(greedy_d, greedy_ids[target_row] == draft_ids, u * q_d < p_d)
    acc = torch.zeros(b, max(k_max, 1), dtype=torch.bool, device=dev)
    draft_mat = torch.full((b, max(k_max, 1)), -1, dtype=torch.int64, device=dev)
    if d:
        req_t, pos_t = torch.from_numpy(draft_req).to(dev), torch.from_numpy(draft_pos).to(dev)
        acc[req_t, pos_t] = accept
        draft_mat[req_t, pos_t] = draft_ids
    num_acc = acc.to(torch.int64).cumprod(dim=1).sum(dim=1)
    starts_t = torch.from_numpy(starts).to(dev)
    final_row = starts_t + num_acc

    # The token after the accepted ones: the residual at the first rejection, else the bonus row.
    dist = probs[final_row]
    if d:  # every request's residual, used where it rejected (no host sync on which ones did)
        rejected = (num_acc < torch.from_numpy(num_draft).to(dev)).unsqueeze(1)
        dj = (torch.from_numpy(d_starts).to(dev) + num_acc).clamp(max=d - 1)  # the rejected proposal's index
        if draft_probs is not None:
            q = draft_probs[dj]
        else:
            q = torch.zeros_like(dist).scatter_(1, draft_ids[dj].view(-1, 1), 1.0)
        resid = (dist - q).clamp_(min=0)
        mass = resid.sum(dim=1, keepdim=True)
        ok = mass > 1e-12  # p == q up to rounding: a rejection of probability ~0; fall back to p
        dist = torch.where(rejected & ok, resid / mass.clamp(min=1e-30), dist)
    final = random_sample(dist, dict(generators or {}))
    final = torch.where(is_greedy, greedy_ids[final_row], final)

    out = torch.full((b, k_max + 1), -1, dtype=torch.int64, device=dev)
    cols = torch.arange(k_max + 1, device=dev)
    if k_max:
        keep = cols[:k_max].unsqueeze(0) < num_acc.unsqueeze(1)
        out[:, :k_max] = torch.where(keep, draft_mat[:, :k_max], out[:, :k_max])
    out.scatter_(1, num_acc.view(-1, 1), final.view(-1, 1))
    rows = starts_t.unsqueeze(1) + torch.minimum(cols.unsqueeze(0), num_acc.unsqueeze(1))
    return VerifyOutput(out, num_acc + 1, rows)


def greedy_verify(argmax: torch.Tensor, draft_token_ids: torch.Tensor, num_draft: np.ndarray) -> VerifyOutput:
    """`rejection_sample` when every request is greedy, on the device without a host sync: request b keeps its
    proposals up to the first that differs from its row's argmax, then emits that row's argmax. argmax [R]
    (R = sum(num_draft + 1), request by request), draft_token_ids [D]."""
    dev = argmax.device
    b = len(num_draft)
    k_max = int(num_draft.max(initial=0))
    n_rows = num_draft + 1
    starts = np.cumsum(n_rows) - n_rows
    cols = np.arange(k_max + 1)
    rows = torch.from_numpy(starts[:, None] + np.minimum(cols[None, :], num_draft[:, None])).to(dev, non_blocking=True)
    target = argmax[rows]
    if k_max:
        d = int(num_draft.sum())
        draft_req = np.repeat(np.arange(b), num_draft)
        draft_pos = np.arange(d) - np.repeat(np.cumsum(num_draft) - num_draft, num_draft)
        mat = torch.full((b, k_max), -2, dtype=target.dtype, device=dev)
        idx = torch.from_numpy(np.stack([draft_req, draft_pos])).to(dev, non_blocking=True)
        mat[idx[0], idx[1]] = draft_token_ids.to(target.dtype)
        num_acc = (target[:, :k_max] == mat).to(torch.int64).cumprod(dim=1).sum(dim=1)
    else:
        num_acc = torch.zeros(b, dtype=torch.int64, device=dev)
    keep = torch.arange(k_max + 1, device=dev).unsqueeze(0) <= num_acc.unsqueeze(1)
    tokens = torch.where(keep, target, torch.full_like(target, -1))
    return VerifyOutput(tokens, num_acc + 1, rows)
