"""Logprobs of the sampled token, the top k and requested extra ids, gathered for all requesting rows at once
(one topk, the sampled token's logprob by gather and its rank by a comparison count), without a device
synchronization until `to_lists` reads them on the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.logprobs import LogprobsLists


@dataclass
class LogprobsTensors:
    """What `gather_logprobs` computes, still as tensors (on the logits' device until copied): per row,
    the columns of `ids` / `lps` are the sampled token, the top k (k = `ks[row]`, columns 1..max_k) and
    the row's extra token ids (after max_k); `ranks0` is the sampled token's rank, `ex_ranks` the extras'.
    Built without any device synchronization; `to_lists` reads them on the host."""

    ids: torch.Tensor  # [R, 1 + max_k + max_e] int64
    lps: torch.Tensor  # [R, 1 + max_k + max_e] float32
    ranks0: torch.Tensor  # [R] int64
    ex_ranks: torch.Tensor | None  # [R, max_e] int64
    ks: list[int]
    num_extras: list[int]
    max_k: int

    def __len__(self) -> int:
        return len(self.ks)

    def copy_to_host(self) -> LogprobsTensors:
        """Pinned host copies, non-blocking on CUDA: readable once the step's event has completed."""
        if not self.ids.is_cuda:
            return self

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return h.copy_(t, non_blocking=True)

        return LogprobsTensors(
            host(self.ids),  # type: ignore[arg-type]
            host(self.lps),  # type: ignore[arg-type]
            host(self.ranks0),  # type: ignore[arg-type]
            host(self.ex_ranks),
            self.ks,
            self.num_extras,
            self.max_k,
        )

    def to_lists(self) -> LogprobsLists:
        all_ids = self.ids.tolist()
        all_lp = self.lps.tolist()
        ranks0 = self.ranks0.tolist()
        ex_ranks = self.ex_ranks.tolist() if self.ex_ranks is not None else None
        out = LogprobsLists()
        max_k = self.max_k
        top_ranks = list(range(1, max_k + 1))
        for i, (k, e) in enumerate(zip(self.ks, self.num_extras)):
            cols = [0, *range(1, 1 + k)]
            ranks = [ranks0[i], *top_ranks[:k]]
            if e:
                cols.extend(range(1 + max_k, 1 + max_k + e))
                assert ex_ranks is not None
                ranks.extend(ex_ranks[i][:e])
            ids_i, lp_i = all_ids[i], all_lp[i]
            out.token_ids.append([ids_i[c] for c in cols])
            out.logprobs.append([lp_i[c] for c in cols])
            out.ranks.append(ranks)
        return out


def gather_logprobs_tensors(
    logprobs: torch.Tensor,
    num_logprobs: list[int],
    token_ids: torch.Tensor,
    extra_token_ids: list[list[int]] | None = None,
) -> LogprobsTensors:
    """Per row of `logprobs` [R, V]: token_ids[r] first (with its rank), then the top num_logprobs[r]
    (-1 = all V) with ranks 1..k, then extra_token_ids[r]. One topk over all rows (k = the largest)."""
    r, vocab = logprobs.shape
    ks = [vocab if k == -1 else min(k, vocab) for k in num_logprobs]
    max_k = max(ks, default=0)
    tok = token_ids.view(-1, 1).to(torch.int64)
    tok_lp = logprobs.gather(1, tok)
    tok_rank = (logprobs >= tok_lp).sum(dim=-1)
    ids_cols = [tok]
    lp_cols = [tok_lp]
    if max_k > 0:
        top_lp, top_ids = logprobs.topk(max_k, dim=-1)
        ids_cols.append(top_ids)
        lp_cols.append(top_lp)
    extras = extra_token_ids or [[] for _ in range(r)]
    max_e = max((len(e) for e in extras), default=0)
    ex_rank = None
    if max_e:
        padded = np.array([e + [0] * (max_e - len(e)) for e in extras], dtype=np.int64)
        ex = torch.from_numpy(padded).to(logprobs.device, non_blocking=True)
        ex_lp = logprobs.gather(1, ex)
        ex_rank = torch.stack([(logprobs >= ex_lp[:, j : j + 1]).sum(dim=-1) for j in range(max_e)], dim=1)
        ids_cols.append(ex)
        lp_cols.append(ex_lp)
    return LogprobsTensors(
        torch.cat(ids_cols, dim=1), torch.cat(lp_cols, dim=1), tok_rank, ex_rank, ks, [len(e) for e in extras], max_k
    )


def gather_logprobs(
    logprobs: torch.Tensor,
    num_logprobs: list[int],
    token_ids: torch.Tensor,
    extra_token_ids: list[list[int]] | None = None,
) -> LogprobsLists:
    """`gather_logprobs_tensors`, read on the host at once (synchronizes with the device)."""
    return gather_logprobs_tensors(logprobs, num_logprobs, token_ids, extra_token_ids).to_lists()
