"""Batch-invariant mode (vLLM's VLLM_BATCH_INVARIANT): a token's outputs must not depend on what else is in
the batch, on whether its prefix came from the prefix cache, or on how its prompt was chunked, so that
greedy and seeded sampling give bitwise identical tokens and logprobs (RL on-policy training needs the
rollout's logprobs to be the trainer's).

What it takes is a reduction order fixed per token:
- matmul: each output row's K-reduction must not depend on the number of rows M. The CPU GEMMs do not
  guarantee it: float32 `F.linear` takes a GEMV path at M = 1, and the oneDNN prepacked bf16 GEMM changes
  its blocking with M for some shapes (K = 1536 at M = 17: one ulp off). The mode packs every linear layer
  and always calls the GEMM on tiles of exactly TILE_ROWS rows (the last one zero-padded), so every row goes
  through the same kernel call shape whatever M is (`tiled_rows`; checked bitwise in
  tests/rl/test_batch_invariant.py).
- attention: the prefill path (SDPA, whose tiling follows the query length, and a masked SDPA over cached
  prefixes) and the decode kernel reduce in different orders. In this mode every query token, prefill or
  decode, goes through the one decode kernel (`csrc/paged_attn.c`: one query row over its keys in block
  order, one thread per row), so a token's attention is the same however it was scheduled.
- RMSNorm, activations, rotary, log-softmax and argmax reduce within a row, sequentially: invariant already.

On the GPU (`batch_invariant_gpu.py`): cuBLAS picks kernels and split-K by M and the Triton attention picks
tiles and split-KV by the batch, so the mode sends every linear layer and the LM head through one Triton matmul
whose configuration depends on (N, K) only, and runs the attention with one tile shape and no split-KV.
Covered: the dense decoder path (unquantized linear layers, Triton attention). Not covered: fused MoE,
quantized or LoRA linear layers.

Enabled by `batch_invariant=True` (engine argument) or `PAGEDLLM_BATCH_INVARIANT=1`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm import envs

_ENABLED = False

TILE_ROWS = 16
"""Rows per GEMM call in the mode: decode batches of 1 pay for 16 rows (cheap on the CPU, where a GEMV is
bound by reading the weight), large batches pay one call per 16 rows."""


def env_enabled() -> bool:
    return envs.PAGEDLLM_BATCH_INVARIANT


def enabled() -> bool:
    return _ENABLED


def set_enabled(flag: bool) -> None:
    global _ENABLED
    _ENABLED = bool(flag)


def tiled_rows(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], tile: int = TILE_ROWS) -> torch.Tensor:
    """fn (a row-wise GEMM) over x [M, K] in calls of exactly `tile` rows; returns [M, N]."""
    m = x.shape[0]
    pad = (-m) % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    outs = [fn(x[i : i + tile]) for i in range(0, x.shape[0], tile)]
    y = outs[0] if len(outs) == 1 else torch.cat(outs)
    return y[:m] if pad else y
