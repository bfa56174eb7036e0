"""CUDA graphs for pure-decode steps: captured once at start-up for a ladder of batch sizes; a step of
n decodes pads up to the next captured size and replays it after copying its inputs into the graph's
persistent buffers. Padded rows get seq_len 0 (the attention kernel yields zeros) and slot -1 (nothing
is written to the KV cache). Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backends.abstract import CommonAttentionMetadata
from pagedllm.forward_context import set_forward_context
from pagedllm.logger import init_logger
from pagedllm.worker.async_output import Patch
from pagedllm.worker.attn_inputs import metadata_by_layer

logger = init_logger(__name__)


def capture_sizes(max_num_seqs: int, cap: int = 512) -> list[int]:
    top = min(max_num_seqs, cap)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        groups: list[Any],
        builders: list[Any],
        max_num_seqs: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.groups = groups
        self.builders = builders
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        cap = self.sizes[-1]
        self.max_size = cap
        self.max_model_len = max_model_len
        # Input ids, positions, each group's slots and seq_lens (int32, two per int64) live in one int64
        # buffer, so a step uploads them with one copy from a host mirror of the same layout.
        n_groups = len(groups)
        header = torch.zeros(cap * (2 + n_groups) + (cap + 1) // 2, dtype=torch.long, device=device)
        self._header = header
        self._header_host = np.zeros(header.shape[0], dtype=np.int64)
        host = self._header_host
        self.input_ids, self._ids_host = header[:cap], host[:cap]
        self.positions, self._pos_host = header[cap : 2 * cap], host[cap : 2 * cap]
        self.slots = [header[cap * (2 + g) : cap * (3 + g)] for g in range(n_groups)]
        self._slots_host = [host[cap * (2 + g) : cap * (3 + g)] for g in range(n_groups)]
        self.seq_lens = header[cap * (2 + n_groups) :].view(torch.int32)[:cap]
        self._seq_host = host[cap * (2 + n_groups) :].view(np.int32)[:cap]
        self.qsl = torch.arange(cap + 1, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros(cap, max_blocks_per_req, dtype=torch.int32, device=device) for _ in groups]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, dict[str, Any]]] = {}
        self.pool: Any = None

    def _metadata(self, size: int) -> dict[str, Any]:
        """Metadata over the persistent buffers for a batch of `size` decodes (the values are set per step)."""
        qsl_cpu = torch.arange(size + 1, dtype=torch.int32)
        commons = [
            CommonAttentionMetadata(
                query_start_loc=self.qsl[: size + 1],
                query_start_loc_cpu=qsl_cpu,
                seq_lens=self.seq_lens[:size],
                seq_lens_cpu=torch.ones(size, dtype=torch.int32),
                num_computed_tokens_cpu=torch.zeros(size, dtype=torch.int32),
                block_table=self.block_tables[g][:size],
                slot_mapping=self.slots[g][:size],
                num_reqs=size,
                num_actual_tokens=size,
                max_query_len=1,
                max_seq_len=self.max_model_len,
            )
            for g in range(len(self.groups))
        ]
        return metadata_by_layer(self.builders, self.groups, commons)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        self.seq_lens.zero_()
        for s in self.slots:
            s.fill_(-1)
        torch.cuda.synchronize(self.device)
        for size in reversed(self.sizes):  # largest first: later graphs reuse its memory pool
            md = self._metadata(size)
            with set_forward_context(md):
                self.model(self.input_ids[:size], self.positions[:size])  # warm-up (autotune, compile)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                with set_forward_context(md):
                    out = self.model(self.input_ids[:size], self.positions[:size])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = (graph, out, md)
        torch.cuda.synchronize(self.device)
        logger.info(
            "Captured CUDA graphs for %d decode batch sizes (1..%d) in %.2f s",
            len(self.sizes),
            self.max_size,
            time.perf_counter() - t0,
        )

    def can_run(self, num_reqs: int) -> bool:
        return num_reqs <= self.max_size

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        seq_lens: np.ndarray,
        slots: list[np.ndarray],
        block_tables: list[np.ndarray],
        patch: Patch | None = None,
    ) -> torch.Tensor:
        """Replays the graph for len(input_ids) decodes; returns their hidden states. `patch` (token
        indices, ids on the device) overrides input ids not known on the host yet (async scheduling)."""
        n = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        # Padded rows [n, size): seq_len 0 and slot -1; rows past `size` are not read by this graph.
        self._ids_host[:n] = input_ids  # ids still in flight are patched in below, after the upload
        self._pos_host[:n] = positions
        seq = self._seq_host
        seq[:n] = seq_lens
        seq[n:size] = 0
        for g, sm in enumerate(self._slots_host):
            sm[:n] = slots[g]
            sm[n:size] = -1
        # One upload (from pageable memory: the host mirror may be rewritten as soon as copy_ returns).
        self._header.copy_(torch.from_numpy(self._header_host), non_blocking=True)
        if patch is not None:
            if isinstance(patch[0], slice):
                self.input_ids[patch[0]].copy_(patch[1])
            else:
                self.input_ids[patch[0]] = patch[1]
        for g in range(len(self.groups)):
            bt = block_tables[g]
            # Into a strided slice: PyTorch stages through a contiguous device temporary itself.
            self.block_tables[g][:n, : bt.shape[1]].copy_(torch.from_numpy(bt), non_blocking=True)
        graph, out, _ = self.graphs[size]
        graph.replay()
        return out[:n]
