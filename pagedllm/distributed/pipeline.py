"""Pipeline parallelism: layer ranges per stage, and what the stages exchange each step.

Stage s of p holds layers `get_pp_indices(n, s, p)`; the first stage embeds, the last normalizes, computes
the logits and samples. Every rank builds the same step inputs from the same `SchedulerOutput`, so the
number of tokens is known everywhere and only the activations travel: stage s sends its hidden states and
residual to stage s + 1 (the same tensor-parallel rank).

Only the last stage samples (the other stages have no logits). The earlier stages learn the sampled ids
from the scheduler: a request's next `SchedulerOutput` carries its new tokens
(`CachedRequestData.new_token_ids`), so no stage waits for the last one after its forward and the engine
core keeps up to pp batches in flight (`engine/batch_queue.py`): the stages overlap. CUDA graphs are off
with pp > 1 and async scheduling is turned off.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.distributed import parallel_state as ps

Intermediate = tuple[torch.Tensor, torch.Tensor]
"""(hidden states, residual) between two stages, [num_tokens, hidden_size] each."""


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of stage `pp_rank`'s layers: an even split, the first stages taking one more."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size: {pp_size} stages for {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class PPMissingLayer(nn.Identity):
    """Stands where another stage's layer (or embedding, norm, LM head) is: no parameters."""


def is_first_stage() -> bool:
    return ps.get_pipeline_model_parallel_rank() == 0


def is_last_stage() -> bool:
    return ps.get_pipeline_model_parallel_rank() == ps.get_pipeline_model_parallel_world_size() - 1


class PipelineStage:
    """This rank's side of the per-step exchange (the model runner holds one when pp > 1)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        rank = dist.get_rank()
        tp = ps.get_tensor_model_parallel_world_size()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.pp_size = ps.get_pipeline_model_parallel_world_size()
        self.is_first = self.pp_rank == 0
        self.is_last = self.pp_rank == self.pp_size - 1
        self.prev_rank = rank - tp
        self.next_rank = rank + tp
        self.last_rank = rank + (self.pp_size - 1 - self.pp_rank) * tp
        self.group = ps.get_pp_group()

    def forward(self, model: Any, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """The stage's forward: activations in from the previous stage, out to the next. The hidden states
        on the last stage, None elsewhere."""
        intermediate: Intermediate | None = None
        if not self.is_first:
            n = input_ids.shape[0]
            hidden = torch.empty(n, self.hidden_size, dtype=self.dtype, device=self.device)
            residual = torch.empty_like(hidden)
            self.dist.recv(hidden, src=self.prev_rank)
            self.dist.recv(residual, src=self.prev_rank)
            intermediate = (hidden, residual)
        out = model(input_ids, positions, intermediate)
        if self.is_last:
            return out
        hidden, residual = out
        works = [self.dist.isend(t.contiguous(), dst=self.next_rank) for t in (hidden, residual)]
        for w in works:
            if w is not None:
                w.wait()
        return None

    def follow_step(self, x: Any, batch: Any, in_flight: Any) -> Any:
        """A stage before the last after its forward: an empty `PendingStep` (nothing sampled here; the
        tokens the last stage samples come with the requests' next steps)."""
        import numpy as np

        from pagedllm.worker.async_output import PendingStep

        batch.num_computed_tokens[x.rows] = x.seq_lens
        in_flight.clear()
        return PendingStep(x.req_ids, np.zeros(0, dtype=np.int64))
