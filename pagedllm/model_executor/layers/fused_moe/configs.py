"""Tile configurations of the fused MoE grouped GEMMs, keyed by (E, N, K, batch bucket).

N is the experts' intermediate size per tensor-parallel rank, K the hidden size, the bucket the number
of tokens T rounded up to a power of two (capped at the largest entry). Each entry holds the up (gate+up)
GEMM's and the down GEMM's tiles; both share BLOCK_M (the alignment of the expert-sorted order).
`TUNED` comes from `benchmarks/moe_tune.py` on an H200 for the W6 (Qwen3-30B-A3B) shapes; shapes not in
it get `default_config`, sized by the expected tokens per expert.
"""

from __future__ import annotations

Config = dict[str, int]


def _cfg(bm: int, bn: int, bk: int, gm: int, warps: int, stages: int) -> Config:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": warps, "num_stages": stages}


# (E, N, K) -> {bucket: (up config, down config)}; filled in from benchmarks/moe_tune.py results.
TUNED: dict[tuple[int, int, int], dict[int, tuple[Config, Config]]] = {}


def default_config(num_experts: int, top_k_tokens: int) -> tuple[Config, Config]:
    """Tiles by the mean number of (token, expert) pairs per expert: 16-row blocks while experts see a
    handful of rows (decode, bandwidth-bound: wide K tiles, deep pipelines), 64-row blocks for prefill."""
    per_expert = top_k_tokens / max(1, num_experts)
    if per_expert <= 24:
        c = _cfg(16, 64, 128, 1, 4, 4)
    elif per_expert <= 96:
        c = _cfg(32, 64, 128, 4, 4, 3)
    else:
        c = _cfg(64, 128, 64, 8, 8, 3)
    return c, c


def get_config(num_experts: int, inter: int, hidden: int, num_tokens: int, top_k: int = 8) -> tuple[Config, Config]:
    """The (up, down) tiles for a batch of `num_tokens` tokens."""
    table = TUNED.get((num_experts, inter, hidden))
    if table:
        bucket = 1 << max(0, (num_tokens - 1).bit_length())
        keys = sorted(table)
        key = next((k for k in keys if k >= bucket), keys[-1])
        return table[key]
    return default_config(num_experts, num_tokens * top_k)
