"""The logits gather through one all-reduce (`symm_allreduce.gather_last_dim_by_sum`): what every rank gets
back equals the ranks' parts concatenated in rank order, bitwise (x + 0 is exact). The ranks are simulated in
one process: the all-reduce is the sum of what each rank put in."""

from __future__ import annotations

import pytest
import torch

from pagedllm.distributed.symm_allreduce import gather_last_dim_by_sum


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 7), (5, 16), (2, 3, 8)])
def test_gather_by_sum_equals_concat(world: int, shape: tuple[int, ...]) -> None:
    torch.manual_seed(world)
    parts = [torch.randn(shape) * 100 for _ in range(world)]
    staged: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        staged.append(t.clone())
        return t

    for rank in range(world):
        gather_last_dim_by_sum(parts[rank], rank, world, record)
    total = torch.stack(staged).sum(0)  # what the all-reduce hands every rank
    got = total.reshape(*shape[:-1], world * shape[-1])
    assert torch.equal(got, torch.cat(parts, dim=-1))
