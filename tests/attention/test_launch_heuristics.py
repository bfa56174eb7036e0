"""The GPU attention's launch heuristics are host-side functions of the batch shape (no GPU needed): which steps
run one tile per request, and with what tile."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.ops.triton_paged_attn import launch_config, one_tile_rows


@pytest.mark.parametrize(
    ("q", "group", "rows"),
    [
        (1, 1, 16),
        (1, 3, 16),
        (1, 32, 32),  # a decode keeps its one tile whatever the group
        (5, 3, 16),  # SmolLM2 (group 3) verifying k = 4
        (6, 3, 32),  # ... k = 5..9: 32 rows, no longer the 128-row prefill tile
        (10, 3, 32),
        (11, 3, None),
        (8, 4, 32),  # Llama-3.1-8B (group 4) verifying k = 7
        (16, 2, 32),
        (32, 1, 32),
        (33, 1, None),
        (2, 32, None),
    ],
)
def test_one_tile_rows(q: int, group: int, rows: int | None) -> None:
    assert one_tile_rows(q, group) == rows
    if rows is not None:  # the tile holds every query row of a request: the launch runs one program per request
        assert rows // group >= q


def test_launch_config_tiles() -> None:
    bm, tile_n, _, _ = launch_config(64, 3, torch.bfloat16, 8)
    assert (bm, tile_n) == (32, 128)
    bm, _, _, _ = launch_config(64, 3, torch.bfloat16, 11)
    assert bm == 128  # a chunk: the prefill tile
