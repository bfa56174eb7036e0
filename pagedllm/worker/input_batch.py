"""The persistent input batch: per-request state kept across steps in fixed rows, updated by the
scheduler's diffs (new requests, appended blocks, finished/preempted ids) instead of rebuilt."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.sample.penalties import TokenCountSlots
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[list[int]]
    num_computed_tokens: int
    """As of the request's (re-)entry into the batch; while it runs, InputBatch.num_computed_tokens has
    the current value."""
    lora_id: int | None = None
    extra: dict = field(default_factory=dict)
    mm_features: list | None = None
    """The prompt's images (`multimodal.inputs.MultiModalFeature`), None for a text prompt."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        num_groups: int,
        vocab_size: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = [np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32) for _ in range(num_groups)]
        self.num_blocks = np.zeros((num_groups, max_num_reqs), dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        # Penalties: scalars per row; token counts only for rows that use them (a slot of `token_counts`,
        # filled from the prompt/output at add time, then incremented per sampled token).
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.penalty_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        self.vocab_size = vocab_size
        self.token_counts = TokenCountSlots(vocab_size, max_num_reqs, device or torch.device("cpu"))
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs
        self._free_rows = list(range(max_num_reqs))
        """A min-heap: a request takes the lowest free row, whatever order rows were freed in. The ranks of
        a tensor- or pipeline-parallel group then put the same requests in the same rows (the flattened
        token order, hence the activations exchanged, follow the rows), although each iterates the step's
        `finished_req_ids` set in its own (per-process hash) order."""
        self.version = 0
        """Bumped whenever a request enters or leaves a row: per-row data derived from the batch (the
        model runner's cached row order and per-row lists) stays valid while it is unchanged."""

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def add_request(self, st: CachedRequestState) -> int:
        if st.req_id in self.req_id_to_row:
            self.remove_request(st.req_id)
        row = heapq.heappop(self._free_rows)
        self.version += 1
        self.req_ids[row] = st.req_id
        self.req_id_to_row[st.req_id] = row
        self.states[row] = st
        n_prompt = len(st.prompt_token_ids)
        n = st.num_tokens
        self.token_ids[row, :n_prompt] = st.prompt_token_ids
        self.token_ids[row, n_prompt:n] = st.output_token_ids
        self.num_tokens[row] = n
        self.num_computed_tokens[row] = st.num_computed_tokens
        for g, ids in enumerate(st.block_ids):
            self.block_tables[g][row, : len(ids)] = ids
            self.num_blocks[g, row] = len(ids)
        sp = st.sampling_params
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k
        self.min_p[row] = sp.min_p
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        if sp.has_penalties:
            self.penalty_slot[row] = self.token_counts.acquire(st.prompt_token_ids, st.output_token_ids)
        return row

    def remove_request(self, req_id: str) -> CachedRequestState | None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return None
        self.version += 1
        st = self.states[row]
        if self.penalty_slot[row] >= 0:
            self.token_counts.release(int(self.penalty_slot[row]))
            self.penalty_slot[row] = -1
        self.req_ids[row] = None
        self.states[row] = None
        heapq.heappush(self._free_rows, row)
        return st

    def append_block_ids(self, row: int, new_block_ids: tuple[list[int], ...]) -> None:
        for g, ids in enumerate(new_block_ids):
            start = int(self.num_blocks[g, row])
            self.block_tables[g][row, start : start + len(ids)] = ids
            self.num_blocks[g, row] = start + len(ids)

    def append_block_ids_rows(self, rows: list[int], new_block_ids: list[tuple[list[int], ...]]) -> None:
        """`append_block_ids` for several distinct rows; one block per row and group (a decode crossing a
        block boundary, the usual case) in one indexed write per group."""
        for g in range(len(self.block_tables)):
            if any(len(ids[g]) != 1 for ids in new_block_ids):
                for row, ids in zip(rows, new_block_ids):
                    self.append_block_ids(row, ids)
                return
        rows_np = np.asarray(rows, dtype=np.int64)
        for g, table in enumerate(self.block_tables):
            cols = self.num_blocks[g, rows_np]
            table[rows_np, cols] = [ids[g][0] for ids in new_block_ids]
            self.num_blocks[g, rows_np] = cols + 1

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """`append_token` for many rows at once (distinct rows)."""
        n = self.num_tokens[rows]
        if int(n.max(initial=-1)) < self.max_model_len:  # every row has room (the usual case): no masking
            self.token_ids[rows, n] = tokens
        else:
            fits = n < self.max_model_len
            self.token_ids[rows[fits], n[fits]] = tokens[fits]
        self.num_tokens[rows] = n + 1

    def count_output_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Add this step's sampled tokens to the output counts of the penalized rows among `rows`."""
        slots = self.penalty_slot[rows]
        keep = slots >= 0
        if keep.any():
            self.token_counts.add_tokens(slots[keep], np.asarray(tokens)[keep])
