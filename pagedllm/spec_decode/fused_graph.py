"""A plain greedy verification step under async n-gram speculation as one CUDA graph per batch size.

The graph runs, on the device alone: the q-row graph's input fix-up from the request histories
(`triton_ngram.fixup_graph_inputs`), the forward over q rows per request, the logits of every row, their argmax,
the verdict + history append + next proposals (`triton_ngram.verify_append_propose`), and the packed result
(`async_ngram.pack`). The host's share of a step is then one header upload (the q-row graph's padding rows, each
request's history slot and proposal count in `CudaGraphRunner.extra`), the block tables and the replay (the
caller copies the result to the host). Launched apart, the step's logits, argmax and verdict kernels cost
the host a few hundred us per step; at batch 16 the fused step ran 1.2-1.3x faster (NOTES, session 22), at
batch 1, where the device bounds the step, as fast.

Requests past n in a captured size are padding: proposal count -1, which both kernels skip (their graph rows
keep the host's slot -1 / seq_len 0, and no history is touched).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagedllm.forward_context import set_forward_context
from pagedllm.logger import init_logger
from pagedllm.sample import triton_argmax
from pagedllm.spec_decode import triton_ngram
from pagedllm.spec_decode.async_ngram import DeviceHistory, pack
from pagedllm.worker.cuda_graph import CudaGraphRunner

logger = init_logger(__name__)

MAX_SIZE = 32
"""Captured sizes up to this many requests (the logits of size * q rows stay in the graph pool; the host's share
of a step matters most at small batches)."""


def extra_words(max_size: int) -> int:
    """The `CudaGraphRunner.extra` words the fused graphs need: each request's history slot and proposal count."""
    return 2 * max_size


class FusedVerifyGraphs:
    def __init__(
        self,
        vg: CudaGraphRunner,
        history: DeviceHistory,
        model: torch.nn.Module,
        block_sizes: list[int],
        max_model_len: int,
    ) -> None:
        cap = vg.max_size
        assert vg.extra.shape[0] >= extra_words(cap)
        self.vg, self.history, self.model = vg, history, model
        self.block_sizes, self.max_model_len = block_sizes, max_model_len
        self.sizes = [s for s in vg.sizes if s <= MAX_SIZE]
        self.slots, self.num_drafts = vg.extra[:cap], vg.extra[cap : 2 * cap]
        self._slots_host, self._nd_host = vg.extra_host[:cap], vg.extra_host[cap : 2 * cap]
        self.starts = torch.arange(cap, dtype=torch.long, device=vg.device) * vg.q
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_runs = 0
        """Replays (tests and stats)."""

    def _step(self, size: int) -> torch.Tensor:
        vg, hist = self.vg, self.history
        slots, nd = self.slots[:size], self.num_drafts[:size]
        triton_ngram.fixup_graph_inputs(vg, hist, slots, nd, self.block_sizes, self.max_model_len)
        t = size * vg.q
        hidden = self.model(vg.input_ids[:t], vg.positions[:t])
        am = triton_argmax.argmax_rows(self.model.compute_logits(hidden))  # type: ignore[operator]
        return pack(*triton_ngram.verify_append_propose(hist, slots, nd, self.starts[:size], am))

    @torch.inference_mode()
    def capture(self) -> None:
        """After the q-row graphs' capture (their metadata and memory pool): largest size first."""
        t0 = time.perf_counter()
        vg = self.vg
        self._slots_host[:] = 0
        self._nd_host[:] = -1  # every request padding: nothing is written to the KV cache or the histories
        for size in reversed(self.sizes):
            vg.stage_fixed(0, [], size)
            md = vg.graphs[size][2]
            with set_forward_context(md):
                self._step(size)  # compiles this shape's kernels, allocates the split kernels' counters
            torch.cuda.synchronize(vg.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=vg.pool), set_forward_context(md):
                out = self._step(size)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(vg.device)
        logger.info(
            "Captured fused verification graphs for %d batch sizes (1..%d) in %.2f s",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - t0,
        )

    def can_run(self, n: int) -> bool:
        return 0 < n <= self.sizes[-1]

    def launch(self, slots: np.ndarray, num_drafts: np.ndarray, block_tables: list[np.ndarray]) -> torch.Tensor:
        """Replays the graph for n = len(slots) decodes (history slots, proposal rows each): their packed result
        [n, K + 3] on the device (`async_ngram.pack`), valid until the next replay."""
        n = len(slots)
        size = self.sizes[int(np.searchsorted(self.sizes, n))]
        self._slots_host[:n] = slots
        self._slots_host[n:size] = 0
        self._nd_host[:n] = num_drafts
        self._nd_host[n:size] = -1
        self.vg.stage_fixed(n, block_tables, size)
        graph, out = self.graphs[size]
        graph.replay()
        self.num_runs += 1
        return out[:n]
