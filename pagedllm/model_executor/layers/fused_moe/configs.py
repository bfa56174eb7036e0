"""Tile configurations of the fused MoE grouped GEMMs, keyed by (E, N, K, batch bucket).

N is the experts' intermediate size per tensor-parallel rank, K the hidden size, the bucket the number
of tokens T rounded up to a power of two (the nearest tuned bucket at or above it, else the largest).
Each entry holds the up (gate+up) GEMM's and the down GEMM's tiles; both share BLOCK_M (the alignment
of the expert-sorted order). Tuned tables are JSON files `E{E}_N{N}_K{K}.json` in `tuned/` (written by
`benchmarks/moe_tune.py` on an H200; Hopper-sized tiles, used on H100 too) or the file named by
`PAGEDLLM_MOE_CONFIG` (which wins); other shapes get `default_config`.
"""

from __future__ import annotations

import json
import os
from functools import cache

from pagedllm import envs

Config = dict[str, int]
Table = dict[int, tuple[Config, Config]]

_TUNED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")


def _cfg(bm: int, bn: int, bk: int, gm: int, warps: int, stages: int) -> Config:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": warps, "num_stages": stages}


def table_file_name(num_experts: int, inter: int, hidden: int) -> str:
    return f"E{num_experts}_N{inter}_K{hidden}.json"


def parse_table(data: dict) -> Table:
    """{"bucket": {"up": {...}, "down": {...}}} -> {bucket: (up, down)}, checked."""
    table: Table = {}
    for bucket, entry in data.items():
        up, down = dict(entry["up"]), dict(entry["down"])
        if up["BLOCK_M"] != down["BLOCK_M"]:
            raise ValueError(f"MoE config bucket {bucket}: up and down BLOCK_M differ")
        table[int(bucket)] = (up, down)
    return table


@cache
def load_table(num_experts: int, inter: int, hidden: int) -> Table | None:
    env = envs.PAGEDLLM_MOE_CONFIG
    paths = [env] if env else []
    paths.append(os.path.join(_TUNED_DIR, table_file_name(num_experts, inter, hidden)))
    for path in paths:
        if path and os.path.isfile(path):
            with open(path) as f:
                data = json.load(f)
            if "shape" in data and tuple(data["shape"]) != (num_experts, inter, hidden):
                continue  # a tuning file for another shape
            return parse_table(data["buckets"])
    return None


def default_config(num_experts: int, top_k_tokens: int) -> tuple[Config, Config]:
    """Tiles by the mean number of (token, expert) pairs per expert: 16-row blocks while experts see a
    handful of rows (decode, bandwidth-bound), 64-row blocks for prefill."""
    per_expert = top_k_tokens / max(1, num_experts)
    if per_expert <= 12:
        c = _cfg(16, 64, 128, 1, 4, 4)
    elif per_expert <= 48:
        c = _cfg(32, 64, 64, 1, 4, 3)
    else:
        c = _cfg(64, 128, 64, 8, 8, 4)
    return c, c


def get_config(num_experts: int, inter: int, hidden: int, num_tokens: int, top_k: int = 8) -> tuple[Config, Config]:
    """The (up, down) tiles for a batch of `num_tokens` tokens."""
    table = load_table(num_experts, inter, hidden)
    if table:
        bucket = 1 << max(0, (num_tokens - 1).bit_length())
        keys = sorted(table)
        key = next((k for k in keys if k >= bucket), keys[-1])
        return table[key]
    return default_config(num_experts, num_tokens * top_k)
