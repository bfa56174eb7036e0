"""The greedy verification of a pure-decode step as CUDA graphs (async n-gram speculation, small batches).

After the verification graph's forward (`worker.cuda_graph.CudaGraphRunner` with q = k + 1 rows per request),
the logits of its rows, their argmax and the verdict + history kernel (`triton_ngram.verify_append_propose`)
replay as one graph per batch size: at batch 1 these were ~8 launches and ~0.3 ms of host time a step, while
the whole step of a small model takes ~1 ms on the device (NOTES, session 21). Padded requests of a size use a
scratch history slot with no proposals. Used when every request samples greedily with nothing that changes its
argmax (no logit bias, allowed tokens, bad words, penalties; min_tokens and logprobs steps run synchronously
anyway)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from pagedllm.logger import init_logger
from pagedllm.sample import triton_argmax
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.async_ngram import DeviceHistory
from pagedllm.spec_decode.triton_ngram import verify_append_propose

logger = init_logger(__name__)

MAX_SIZE = 16
"""Batch sizes up to this get a graph (above it the host's share of a step is small)."""


def plain_greedy(sp: SamplingParams) -> bool:
    """Greedy, and nothing but the model decides the argmax."""
    return (
        sp.temperature < 1e-5
        and not sp.logit_bias
        and sp.allowed_token_ids is None
        and not sp.bad_words_token_ids
        and not sp.min_tokens
        and not sp.has_penalties
    )


class GreedyVerifyGraphs:
    def __init__(self, model: Any, verify: Any, history: DeviceHistory) -> None:
        self.model = model
        self.vg = verify  # worker.cuda_graph.CudaGraphRunner (q = k + 1)
        self.hist = history
        self.q = verify.q
        self.sizes = [s for s in verify.sizes if s <= MAX_SIZE]
        self.max_size = self.sizes[-1] if self.sizes else 0
        dev = history.device
        m = self.max_size
        self.meta = torch.zeros(2 * m, dtype=torch.long, device=dev)
        """Per request of the step: its history slot, then its proposal rows (padding: the scratch slot, 0)."""
        self._meta_host = np.zeros(2 * m, dtype=np.int64)
        self.starts = torch.arange(m, dtype=torch.long, device=dev) * self.q
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_replays = 0

    def slots(self, n: int) -> torch.Tensor:
        return self.meta[:n]

    def num_drafts(self, n: int) -> torch.Tensor:
        return self.meta[self.max_size : self.max_size + n]

    def _post(self, size: int) -> torch.Tensor:
        out = self.vg.graphs[size][1]  # the forward graph's hidden states, size * q rows
        logits = self.model.compute_logits(out)
        am = triton_argmax.argmax_rows(logits)
        m = self.max_size
        tok, cnt, real = verify_append_propose(
            self.hist, self.meta[:size], self.meta[m : m + size], self.starts[:size], am
        )
        return torch.cat([tok, cnt.unsqueeze(1), real.unsqueeze(1)], dim=1)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.sizes:
            return
        t0 = time.perf_counter()
        self._meta_host[: self.max_size] = self.hist.scratch
        self._meta_host[self.max_size :] = 0
        self.meta.copy_(torch.from_numpy(self._meta_host))
        pool = self.vg.pool
        for size in reversed(self.sizes):
            self._post(size)  # compiles the kernels of this shape (writes only the scratch slot)
            torch.cuda.synchronize(self.meta.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                res = self._post(size)
            self.graphs[size] = (graph, res)
        torch.cuda.synchronize(self.meta.device)
        logger.info(
            "Captured greedy verification graphs for %d batch sizes (1..%d) in %.2f s",
            len(self.sizes),
            self.max_size,
            time.perf_counter() - t0,
        )

    def can_run(self, n: int) -> bool:
        return n <= self.max_size and bool(self.graphs)

    def upload(self, slots: np.ndarray, num_drafts: np.ndarray) -> None:
        """The step's requests' slots and proposal rows, padded, in one copy (before the forward's fix-up)."""
        n, m = len(slots), self.max_size
        h = self._meta_host
        h[:n] = slots
        h[n:m] = self.hist.scratch
        h[m : m + n] = num_drafts
        h[m + n :] = 0
        self.meta.copy_(torch.from_numpy(h), non_blocking=True)

    def replay(self, n: int) -> torch.Tensor:
        """After the forward graph of the same size: [n, K + 3] = emitted tokens (K + 1 columns, -1 padded),
        their count, the real proposals among the verified ones."""
        size = self.vg.sizes[np.searchsorted(self.vg.sizes, n)]
        graph, res = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return res[:n]
