"""Attention inputs of a step, built one way for every path (eager steps, warm-up and profiling
forwards; CUDA-graph decode steps take the same block tables and slots into their persistent buffers).

Per KV-cache group: the block-table columns in use for the scheduled rows and each new token's flat
cache slot; then one `CommonAttentionMetadata` per group, with the values shared by every group
(`query_start_loc`, `seq_lens`) uploaded once; then each group's backend metadata keyed by layer name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backends.abstract import AttentionMetadataBuilder, CommonAttentionMetadata
from pagedllm.core.kv_cache_utils import KVCacheGroup
from pagedllm.utils import cdiv


def tables_and_slots(
    block_tables: Sequence[np.ndarray],
    block_sizes: Sequence[int],
    rows: np.ndarray,
    req_of_token: np.ndarray,
    positions: np.ndarray,
    max_seq_len: int,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per group: the rows' block-table columns in use (a position p < seq_len has its block
    p // block_size < cdiv(max_seq_len, block_size), so only those are copied: the whole width is
    max_model_len / block_size columns) and each token's slot, block id * block_size + offset."""
    tables, slots = [], []
    for table, bs in zip(block_tables, block_sizes, strict=True):
        bt = table[rows, : cdiv(max_seq_len, bs)]
        slots.append(bt[req_of_token, positions // bs].astype(np.int64) * bs + positions % bs)
        tables.append(bt)
    return tables, slots


def build_commons(
    cu: np.ndarray,
    seq_lens: np.ndarray,
    computed: np.ndarray,
    tables: Sequence[np.ndarray],
    slots: Sequence[np.ndarray],
    max_query_len: int,
    device: torch.device,
    causal: bool = True,
    kv_cache_free: bool = False,
    key_limit: np.ndarray | None = None,
) -> list[CommonAttentionMetadata]:
    """One `CommonAttentionMetadata` per group from host arrays: `cu` the query start offsets
    [num_reqs + 1], `seq_lens` / `computed` per request, `tables` / `slots` per group, `key_limit` per token
    (None: causal)."""
    qsl_cpu = torch.from_numpy(cu.astype(np.int32))
    seq_cpu = torch.from_numpy(seq_lens.astype(np.int32))
    computed_cpu = torch.from_numpy(computed.astype(np.int32))
    qsl_dev = qsl_cpu.to(device, non_blocking=True)  # uploaded once for all groups (the same values)
    seq_dev = seq_cpu.to(device, non_blocking=True)
    num_reqs, total, max_seq = len(seq_lens), int(cu[-1]), int(seq_lens.max())
    limit_cpu = limit_dev = None
    if key_limit is not None:
        limit_cpu = torch.from_numpy(key_limit.astype(np.int32))
        limit_dev = limit_cpu.to(device, non_blocking=True)
    return [
        CommonAttentionMetadata(
            query_start_loc=qsl_dev,
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_dev,
            seq_lens_cpu=seq_cpu,
            num_computed_tokens_cpu=computed_cpu,
            block_table=torch.from_numpy(bt).to(device, non_blocking=True),
            slot_mapping=torch.from_numpy(sm).to(device, non_blocking=True),
            num_reqs=num_reqs,
            num_actual_tokens=total,
            max_query_len=max_query_len,
            max_seq_len=max_seq,
            causal=causal,
            kv_cache_free=kv_cache_free,
            key_limit=limit_dev,
            key_limit_cpu=limit_cpu,
        )
        for bt, sm in zip(tables, slots, strict=True)
    ]


def metadata_by_layer(
    builders: Sequence[AttentionMetadataBuilder],
    groups: Sequence[KVCacheGroup],
    commons: Sequence[CommonAttentionMetadata],
) -> dict[str, Any]:
    """Each group's backend metadata (built from its `commons` entry), keyed by layer name."""
    out: dict[str, Any] = {}
    for builder, group, common in zip(builders, groups, commons, strict=True):
        out.update(dict.fromkeys(group.layer_names, builder.build(common)))
    return out
