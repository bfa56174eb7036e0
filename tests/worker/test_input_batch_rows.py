"""Row assignment in the persistent batch does not depend on the order requests leave it: the ranks of a
tensor- or pipeline-parallel group iterate the step's `finished_req_ids` set in different (per-process
hash) orders, and must still put the same requests in the same rows (their activations follow rows)."""

from __future__ import annotations

import random

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import CachedRequestState, InputBatch


def _state(rid: str) -> CachedRequestState:
    return CachedRequestState(rid, [1, 2, 3], [], SamplingParams(), None, [[1]], 0)


def test_rows_independent_of_removal_order() -> None:
    layouts = []
    for order_seed in range(4):
        batch = InputBatch(8, 32, 4, 1)
        for i in range(8):
            batch.add_request(_state(f"a{i}"))
        gone = ["a1", "a4", "a6", "a7"]
        random.Random(order_seed).shuffle(gone)  # the set's iteration order differs per rank
        for rid in gone:
            batch.remove_request(rid)
        for i in range(3):
            batch.add_request(_state(f"b{i}"))
        layouts.append(dict(batch.req_id_to_row))
    assert all(layout == layouts[0] for layout in layouts)
    assert [layouts[0][f"b{i}"] for i in range(3)] == [1, 4, 6]  # the lowest free rows, in order
