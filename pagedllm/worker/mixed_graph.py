"""Whole-step CUDA graphs for prefill and mixed steps: one replay per step, attention included.

Piecewise graphs (worker/piecewise_graph.py) still run every layer's attention eagerly: ~200 us of Python
and Triton launches per layer, 7.9 ms of host time per 8B prefill step on the H100 host (benchmarks/NOTES.md,
session 17), which makes a step that admits a request host-bound. The Triton attention's launches can be
made independent of the batch's shape, so the whole forward is captured once per padded token count T:

- requests are padded to R = min(T, max_num_seqs) with empty ones (query length 0: `query_start_loc`
  repeats the real token count, seq_len 0), which every attention program skips;
- token rows are padded to T with slot -1 (no cache write) at position 0;
- the attention's host-side choices are fixed per T: always the two launches of a mixed batch (decode tiles
  for one-token queries, one program per request; prefill tiles for the others, over an upper-bound grid
  of T / BLOCK_Q + R token tiles whose surplus programs exit at once), no split-KV.

A step copies its ids, positions, slots, seq_lens and query offsets into one persistent buffer (one upload)
and its block-table rows into another, then replays the graph of the next size up. Pure-decode steps keep
their own graphs (worker/cuda_graph.py), whose decode-only kernels are faster for them.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

import numpy as np
import torch

from pagedllm import envs
from pagedllm.attention.backends.abstract import CommonAttentionMetadata
from pagedllm.logger import init_logger
from pagedllm.utils import cdiv
from pagedllm.worker.async_output import Patch
from pagedllm.worker.attn_inputs import metadata_by_layer
from pagedllm.worker.cuda_graph import GraphEntry, capture_ladder, fill_token_rows, upload_inputs
from pagedllm.worker.piecewise_graph import (
    PiecewiseGraphRunner,
    capture_piecewise,
    mixed_graph_max_tokens,
    piecewise_sizes,
)

logger = init_logger(__name__)


def launch_shape(size: int, num_reqs: int) -> torch.Tensor:
    """The host-side query offsets a graph of `size` tokens and `num_reqs` (padded) requests is captured with:
    they fix the attention's launches (the Triton builder reads only them): a long query (prefill tiles) and,
    with two requests or more, one decode among them (so the decode launch is issued too). The device-side
    offsets are the step's own."""
    shape = torch.full((num_reqs + 1,), size, dtype=torch.int32)
    shape[0] = 0
    if num_reqs > 1:
        shape[1] = 1
    return shape


class MixedGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        groups: list[Any],
        builders: list[Any],
        sizes: list[int],
        max_num_seqs: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        pool: Any = None,
    ) -> None:
        self.model = model
        self.groups = groups
        self.builders = builders
        self.sizes = sizes
        self.max_size = sizes[-1]
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = device
        self.pool = pool
        cap, rcap, ng = self.max_size, self.num_padded_reqs(sizes[-1]), len(groups)
        # ids, positions and each group's slots (int64), then seq_lens and query offsets (int32, two per word):
        # one buffer, so a step uploads them with one copy from a host mirror of the same layout.
        words = cap * (2 + ng) + (2 * rcap + 2) // 2
        self._header = torch.zeros(words, dtype=torch.long, device=device)
        self._host = np.zeros(words, dtype=np.int64)
        self.input_ids, self._ids_host = self._header[:cap], self._host[:cap]
        self.positions, self._pos_host = self._header[cap : 2 * cap], self._host[cap : 2 * cap]
        self.slots = [self._header[cap * (2 + g) : cap * (3 + g)] for g in range(ng)]
        self._slots_host = [self._host[cap * (2 + g) : cap * (3 + g)] for g in range(ng)]
        ints = self._header[cap * (2 + ng) :].view(torch.int32)
        ints_host = self._host[cap * (2 + ng) :].view(np.int32)
        self.seq_lens, self._seq_host = ints[:rcap], ints_host[:rcap]
        self.qsl, self._qsl_host = ints[rcap : 2 * rcap + 1], ints_host[rcap : 2 * rcap + 1]
        self.block_tables = [torch.zeros(rcap, max_blocks_per_req, dtype=torch.int32, device=device) for _ in groups]
        self.graphs: dict[int, GraphEntry] = {}
        self.num_runs = 0
        """Steps replayed through these graphs (tests and stats)."""

    def num_padded_reqs(self, size: int) -> int:
        """Requests a graph of `size` tokens is captured for: every request has at least one token."""
        return min(size, self.max_num_seqs)

    def _metadata(self, size: int) -> dict[str, Any]:
        """Metadata over the persistent buffers, with host values that fix the attention's launches: R
        requests, T tokens, a long query (prefill tiles) and one decode among them (the decode launch too)."""
        r = self.num_padded_reqs(size)
        shape = launch_shape(size, r)
        commons = [
            CommonAttentionMetadata(
                query_start_loc=self.qsl[: r + 1],
                query_start_loc_cpu=shape,
                seq_lens=self.seq_lens[:r],
                seq_lens_cpu=torch.ones(r, dtype=torch.int32),
                num_computed_tokens_cpu=torch.zeros(r, dtype=torch.int32),
                block_table=self.block_tables[g][:r],
                slot_mapping=self.slots[g][:size],
                num_reqs=r,
                num_actual_tokens=size,
                max_query_len=size,
                max_seq_len=self.max_model_len,
            )
            for g in range(len(self.groups))
        ]
        return metadata_by_layer(self.builders, self.groups, commons)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        # Every request empty, every slot -1: the warm-up and capture forwards read and write no cache.
        self.seq_lens.zero_()
        self.qsl.zero_()
        for s in self.slots:
            s.fill_(-1)
        torch.cuda.synchronize(self.device)
        self.graphs, self.pool = capture_ladder(
            self.model, self.sizes, lambda size: size, self._metadata, self.input_ids, self.positions, self.pool
        )
        logger.info(
            "Captured whole-step CUDA graphs for %d token counts (%d..%d) of prefill and mixed steps in %.2f s",
            len(self.sizes),
            self.sizes[0],
            self.max_size,
            time.perf_counter() - t0,
        )

    def can_run(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_size

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        cu: np.ndarray,
        seq_lens: np.ndarray,
        slots: list[np.ndarray],
        block_tables: list[np.ndarray],
        patch: Patch | None = None,
    ) -> torch.Tensor:
        """The hidden states of a step's len(input_ids) tokens (`cu`: its requests' query offsets, `seq_lens`
        their context lengths after the step; `slots` / `block_tables` per KV-cache group, as the eager path
        takes them). `patch` overrides ids still in flight (async scheduling)."""
        n, nr = len(input_ids), len(seq_lens)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        r = self.num_padded_reqs(size)
        assert nr <= r, "a step has at least one token per request"
        fill_token_rows(self._ids_host, self._pos_host, self._slots_host, input_ids, positions, slots, size)
        self._seq_host[:nr] = seq_lens
        self._seq_host[nr:r] = 0
        self._qsl_host[: nr + 1] = cu
        self._qsl_host[nr + 1 : r + 1] = n  # padded requests: empty, after the last real token
        upload_inputs(self._header, self._host, self.input_ids, patch, self.block_tables, block_tables, nr)
        graph, out, _ = self.graphs[size]
        graph.replay()
        self.num_runs += 1
        return out[:n]


def capture_mixed_step_graphs(runner: Any) -> tuple[MixedGraphRunner | None, PiecewiseGraphRunner | None]:
    """A `ModelRunner`'s (typed Any: its module imports this one) graphs for prefill and mixed steps, where they
    apply (`mixed_graph_max_tokens`): whole-step graphs with the Triton attention backend unless
    PAGEDLLM_MIXED_GRAPHS=piecewise, else (or if their capture fails) piecewise graphs."""
    max_tokens = mixed_graph_max_tokens(runner)
    if not max_tokens:
        return None, None
    if envs.PAGEDLLM_MIXED_GRAPHS == "full" and runner.backend.name == "triton":
        groups = runner.kv_cache_config.groups
        mg = MixedGraphRunner(
            runner.model, groups, runner.builders, piecewise_sizes(max_tokens), runner.max_num_reqs,
            cdiv(runner.max_model_len, runner.block_size), runner.max_model_len, runner.device,
            pool=runner.cuda_graphs.pool,
        )  # fmt: skip
        try:
            mg.capture()
            return mg, None
        except Exception as e:  # fall back to the piecewise graphs, which run attention eagerly
            torch.cuda.synchronize(runner.device)
            logger.warning("Whole-step CUDA graphs off: capture failed (%s: %s)", type(e).__name__, e)
    return None, capture_piecewise(runner, max_tokens)
