"""From the step's hidden states to each pooling request's result: one pooling op per step over the
packed hidden states (CLS / LAST / MEAN as one gather or segment sum, ALL as splits), then the task's head
(classifier for classify / score / reward) and post-processing (dimensions, normalize, activation)
batched over the requests that share them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.pooling.config import PoolerConfig
from pagedllm.pooling_params import PooledData, PoolingParams

CLASSIFY_TASKS = ("classify", "score", "reward")


def pool_hidden(hidden: torch.Tensor, cu: np.ndarray, pooling_type: str) -> torch.Tensor | list[torch.Tensor]:
    """[T, H] packed hidden states, `cu` [B+1] sequence offsets -> [B, H] (or B tensors [len, H] for ALL)."""
    dev = hidden.device
    if pooling_type == "CLS":
        return hidden[torch.from_numpy(cu[:-1]).to(dev)]
    if pooling_type == "LAST":
        return hidden[torch.from_numpy(cu[1:] - 1).to(dev)]
    lens = torch.from_numpy(np.diff(cu)).to(dev)
    if pooling_type == "MEAN":
        seg = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens)
        sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32, device=dev)
        sums.index_add_(0, seg, hidden.float())
        return sums / lens[:, None].to(torch.float32)
    if pooling_type == "ALL":
        return list(torch.split(hidden, np.diff(cu).tolist()))
    raise ValueError(f"pooling_type: unknown {pooling_type!r}")


class Pooler:
    """The model's pooler: `pool(hidden, cu, params)` -> one `PooledData` per request."""

    def __init__(self, model: Any, config: PoolerConfig) -> None:
        self.model = model
        self.config = config
        self.classify_fn = getattr(model, "classify", None)

    def pool(self, hidden: torch.Tensor, cu: np.ndarray, params: list[PoolingParams]) -> list[PooledData]:
        tasks = [p.task or "embed" for p in params]
        out: list[torch.Tensor | None] = [None] * len(params)
        token_rows = [i for i, t in enumerate(tasks) if t in ("token_embed", "token_classify", "encode")]
        seq_rows = [i for i, t in enumerate(tasks) if i not in set(token_rows)]
        if seq_rows:
            ptype = self.config.pooling_type or "LAST"
            if ptype == "ALL":
                ptype = "MEAN"
            sub_cu = cu if len(seq_rows) == len(params) else None
            if sub_cu is not None:
                pooled = pool_hidden(hidden, cu, ptype)
            else:  # pool every sequence, keep those rows (the rest are few: token-level requests)
                pooled = pool_hidden(hidden, cu, ptype)[torch.tensor(seq_rows, device=hidden.device)]
            assert isinstance(pooled, torch.Tensor)
            self._sequence_tasks(
                pooled.float(), [params[i] for i in seq_rows], [tasks[i] for i in seq_rows], seq_rows, out
            )
        if token_rows:
            per_seq = pool_hidden(hidden, cu, "ALL")
            for i in token_rows:
                h = per_seq[i].float()
                if tasks[i] == "token_classify" and self.classify_fn is not None:
                    h = self._activate(self.classify_fn(h), params[i])
                elif self._normalize(params[i]) and tasks[i] == "token_embed":
                    h = F.normalize(h, p=2, dim=-1)
                out[i] = h
        done = [t for t in out if t is not None]
        assert len(done) == len(params)
        if done and done[0].device.type != "cpu" and all(t.shape == done[0].shape for t in done):
            # One device-to-host copy for the step, not one (and one sync) per request.
            done = list(torch.stack(done).cpu().unbind(0))
        return [PooledData.from_tensor(t) for t in done]

    def _normalize(self, p: PoolingParams) -> bool:
        if p.normalize is not None:
            return p.normalize
        return self.config.normalize if self.config.normalize is not None else True

    def _activate(self, logits: torch.Tensor, p: PoolingParams) -> torch.Tensor:
        use = p.use_activation if p.use_activation is not None else (self.config.use_activation is not False)
        if p.task == "reward" or not use:
            return logits
        return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)

    def _sequence_tasks(
        self,
        pooled: torch.Tensor,
        params: list[PoolingParams],
        tasks: list[str],
        rows: list[int],
        out: list[torch.Tensor | None],
    ) -> None:
        cls_idx = [j for j, t in enumerate(tasks) if t in CLASSIFY_TASKS]
        if cls_idx:
            if self.classify_fn is None:
                raise ValueError("this model has no classification head")
            sel = pooled if len(cls_idx) == len(tasks) else pooled[torch.tensor(cls_idx, device=pooled.device)]
            logits = self.classify_fn(sel.to(self.model_dtype)).float()
            for k, j in enumerate(cls_idx):
                out[rows[j]] = self._activate(logits[k], params[j])
        emb_idx = [j for j, t in enumerate(tasks) if t not in CLASSIFY_TASKS]
        if not emb_idx:
            return
        # The common case (every request with the model's defaults) in one normalize over the batch.
        plain = [j for j in emb_idx if params[j].dimensions is None and self._normalize(params[j])]
        if plain:
            normed = F.normalize(pooled if len(plain) == len(tasks) else pooled[plain], p=2, dim=-1)
            for k, j in enumerate(plain):
                out[rows[j]] = normed[k]
        for j in emb_idx:
            if out[rows[j]] is not None:
                continue
            v = pooled[j]
            if params[j].dimensions is not None:
                v = v[: params[j].dimensions]
            out[rows[j]] = F.normalize(v, p=2, dim=-1) if self._normalize(params[j]) else v

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype
