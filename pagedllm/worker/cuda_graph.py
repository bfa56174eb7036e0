"""CUDA graphs for pure-decode steps: captured once at start-up for a ladder of batch sizes; a step of
n decodes pads up to the next captured size and replays it after copying its inputs into the graph's
persistent buffers. Padded rows get seq_len 0 (the attention kernel yields zeros) and slot -1 (nothing
is written to the KV cache). Prefill and mixed steps run eagerly.

With `query_len` q > 1 (speculative decoding's verification steps: a request's last token plus up to q - 1
proposals), every request gets q query rows: a request with fewer tokens is padded at its end with rows
whose slot is -1 and whose outputs are dropped. Its seq_len counts the padded rows, so each real row keeps
its position; the causal mask keeps real rows from seeing the padded ones.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backends.abstract import CommonAttentionMetadata
from pagedllm.forward_context import set_forward_context
from pagedllm.logger import init_logger
from pagedllm.worker.async_output import Patch, apply_patch
from pagedllm.worker.attn_inputs import metadata_by_layer

logger = init_logger(__name__)


GraphEntry = tuple[torch.cuda.CUDAGraph, torch.Tensor, dict[str, Any]]
"""A captured size: its graph, its output buffer and the metadata it was captured with."""


def capture_ladder(
    model: torch.nn.Module,
    sizes: list[int],
    rows: Callable[[int], int],
    metadata: Callable[[int], dict[str, Any]],
    ids: torch.Tensor,
    pos: torch.Tensor,
    pool: Any,
) -> tuple[dict[int, GraphEntry], Any]:
    """One graph per size over the persistent `ids` / `pos` (its first `rows(size)` rows), each after a warm-up
    forward that compiles that shape's kernels; largest first, so the smaller sizes reuse its memory in `pool`
    (None: a new pool). Returns the graphs and the pool."""
    graphs: dict[int, GraphEntry] = {}
    for size in reversed(sizes):
        md, t = metadata(size), rows(size)
        with set_forward_context(md):
            model(ids[:t], pos[:t])
        torch.cuda.synchronize(ids.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool), set_forward_context(md):
            out = model(ids[:t], pos[:t])
        if pool is None:
            pool = graph.pool()
        graphs[size] = (graph, out, md)
    torch.cuda.synchronize(ids.device)
    return graphs, pool


def fill_token_rows(
    ids_host: np.ndarray,
    pos_host: np.ndarray,
    slots_host: list[np.ndarray],
    input_ids: np.ndarray,
    positions: np.ndarray,
    slots: list[np.ndarray],
    size: int,
) -> None:
    """A step's token rows into a graph's host mirror, padded to `size` rows of token 0 at position 0 whose slot
    is -1 (nothing is written to the KV cache); rows past `size` are not read by that graph."""
    n = len(input_ids)
    ids_host[:n] = input_ids  # ids still in flight are patched in on the device, after the upload
    ids_host[n:size] = 0
    pos_host[:n] = positions
    pos_host[n:size] = 0
    for sm, sl in zip(slots_host, slots, strict=True):
        sm[:n] = sl
        sm[n:size] = -1


def upload_inputs(
    header: torch.Tensor,
    host: np.ndarray,
    input_ids: torch.Tensor,
    patch: Patch | None,
    tables: list[torch.Tensor],
    block_tables: list[np.ndarray],
    num_reqs: int,
) -> None:
    """A graph's inputs to the device: its host mirror in one copy (from pageable memory: the mirror may be
    rewritten as soon as copy_ returns), the ids still in flight patched into `input_ids`, and each group's
    block-table rows of the step's requests into its persistent table (a strided slice: PyTorch stages through a
    contiguous device temporary itself)."""
    header.copy_(torch.from_numpy(host), non_blocking=True)
    if patch is not None:
        apply_patch(input_ids, patch)
    for table, bt in zip(tables, block_tables):
        table[:num_reqs, : bt.shape[1]].copy_(torch.from_numpy(bt), non_blocking=True)


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
        query_len: int = 1,
        pool: Any = None,
        extra: int = 0,
    ) -> None:
        """`extra`: int64 words more in the uploaded header (`self.extra`, host `self.extra_host`) for a user's
        per-step device inputs (`spec_decode.fused_graph`)."""
        self.model = model
        self.q = query_len
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
        ct = cap * query_len  # token rows
        seq_words = (cap + 1) // 2
        header = torch.zeros(ct * (2 + n_groups) + seq_words + extra, dtype=torch.long, device=device)
        self._header = header
        self._header_host = np.zeros(header.shape[0], dtype=np.int64)
        host = self._header_host
        self.input_ids, self._ids_host = header[:ct], host[:ct]
        self.positions, self._pos_host = header[ct : 2 * ct], host[ct : 2 * ct]
        self.slots = [header[ct * (2 + g) : ct * (3 + g)] for g in range(n_groups)]
        self._slots_host = [host[ct * (2 + g) : ct * (3 + g)] for g in range(n_groups)]
        self.seq_lens = header[ct * (2 + n_groups) :].view(torch.int32)[:cap]
        self._seq_host = host[ct * (2 + n_groups) :].view(np.int32)[:cap]
        top = ct * (2 + n_groups) + seq_words
        self.extra, self.extra_host = header[top:], host[top:]
        self.qsl = torch.arange(cap + 1, dtype=torch.int32, device=device) * query_len
        self.block_tables = [torch.zeros(cap, max_blocks_per_req, dtype=torch.int32, device=device) for _ in groups]
        self.graphs: dict[int, GraphEntry] = {}
        self.pool: Any = pool
        self.num_padded_runs = 0
        """Replays of the q-row graphs (`run_padded`), for tests and stats."""

    def _metadata(self, size: int) -> dict[str, Any]:
        """Metadata over the persistent buffers for a batch of `size` decodes (the values are set per step)."""
        q = self.q
        qsl_cpu = torch.arange(size + 1, dtype=torch.int32) * q
        commons = [
            CommonAttentionMetadata(
                query_start_loc=self.qsl[: size + 1],
                query_start_loc_cpu=qsl_cpu,
                seq_lens=self.seq_lens[:size],
                seq_lens_cpu=torch.ones(size, dtype=torch.int32),
                num_computed_tokens_cpu=torch.zeros(size, dtype=torch.int32),
                block_table=self.block_tables[g][:size],
                slot_mapping=self.slots[g][: size * q],
                num_reqs=size,
                num_actual_tokens=size * q,
                max_query_len=q,
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
        q = self.q
        self.graphs, self.pool = capture_ladder(
            self.model, self.sizes, lambda size: size * q, self._metadata, self.input_ids, self.positions, self.pool
        )
        logger.info(
            "Captured CUDA graphs for %d batch sizes (1..%d) of %d query token(s) per request in %.2f s",
            len(self.sizes),
            self.max_size,
            self.q,
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
        fill_token_rows(self._ids_host, self._pos_host, self._slots_host, input_ids, positions, slots, size)
        self._seq_host[:n] = seq_lens
        self._seq_host[n:size] = 0  # padded requests: seq_len 0 (the attention yields zeros)
        upload_inputs(self._header, self._header_host, self.input_ids, patch, self.block_tables, block_tables, n)
        graph, out, _ = self.graphs[size]
        graph.replay()
        return out[:n]

    def can_run_padded(self, cu: np.ndarray, seq_lens: np.ndarray) -> bool:
        """Whether a step of requests with cu-delimited query rows fits these graphs (q > 1): few enough
        requests, at most q rows each, and the padded rows within the context."""
        n = len(seq_lens)
        if n > self.max_size or int((cu[1:] - cu[:-1]).max()) > self.q:
            return False
        return int((seq_lens - (cu[1:] - cu[:-1])).max()) + self.q <= self.max_model_len

    def run_fixed(
        self, n: int, block_tables: list[np.ndarray], fixup: Callable[[CudaGraphRunner], None]
    ) -> torch.Tensor:
        """Replays the q-row graph for n requests of q rows each whose ids, positions, slots and lengths `fixup`
        writes on the device after the upload (the host sets only the padded requests': slot -1, seq_len 0);
        returns the hidden states of the n * q rows, request by request."""
        size = self.stage_fixed(n, block_tables)
        fixup(self)
        graph, out, _ = self.graphs[size]
        graph.replay()
        self.num_padded_runs += 1
        return out[: n * self.q]

    def stage_fixed(self, n: int, block_tables: list[np.ndarray], size: int | None = None) -> int:
        """`run_fixed`'s upload: the padded requests' rows (from n to the captured size, or to `size`: slot -1,
        seq_len 0), `extra` as the caller set it, and the block tables; returns the captured size."""
        q = self.q
        if size is None:
            size = self.sizes[bisect.bisect_left(self.sizes, n)]
        t0, t = n * q, size * q
        self._ids_host[t0:t] = 0
        self._pos_host[t0:t] = 0
        for sm in self._slots_host:
            sm[t0:t] = -1
        self._seq_host[n:size] = 0
        upload_inputs(self._header, self._header_host, self.input_ids, None, self.block_tables, block_tables, n)
        return size

    def run_padded(
        self,
        input_ids: np.ndarray,
        seq_lens: np.ndarray,
        cu: np.ndarray,
        slots: list[np.ndarray],
        block_tables: list[np.ndarray],
        fixup: Callable[[CudaGraphRunner], None] | None = None,
    ) -> torch.Tensor:
        """Replays the q-row graph for a step whose requests have at most q query rows each (`cu`: the
        flat rows' request boundaries); returns the hidden states of the real rows, in their flat order.
        `fixup(self)` runs after the inputs' upload, before the replay: it may rewrite them on the device
        (speculation with async scheduling: `spec_decode.async_ngram.fixup_graph_inputs`)."""
        n, q = len(seq_lens), self.q
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        lens = cu[1:] - cu[:-1]
        computed = seq_lens - lens
        t = size * q
        # Row r of request i sits at i * q + (r - cu[i]).
        flat = np.arange(int(cu[-1]), dtype=np.int64)
        dest = flat + np.repeat(np.arange(n, dtype=np.int64) * q - cu[:-1], lens)
        ids = self._ids_host
        ids[:t] = 0
        ids[dest] = input_ids
        pos = self._pos_host[:t].reshape(size, q)
        pos[:n] = computed[:, None] + np.arange(q)[None, :]
        pos[n:] = 0
        seq = self._seq_host
        seq[:n] = computed + q
        seq[n:size] = 0
        for g, sm in enumerate(self._slots_host):
            sm[:t] = -1
            sm[dest] = slots[g]
        upload_inputs(self._header, self._header_host, self.input_ids, None, self.block_tables, block_tables, n)
        if fixup is not None:
            fixup(self)
        # Before the replay: an upload from pageable memory waits for the stream, i.e. for the graph.
        rows = torch.from_numpy(dest).to(self.device, non_blocking=True)
        graph, out, _ = self.graphs[size]
        graph.replay()
        self.num_padded_runs += 1
        return out[rows]
