"""How many KV blocks a step must leave free when it admits waiting requests: the running requests' own growth.

Without a reserve the scheduler admits prompts while their blocks fit, and the running requests' decodes then
run out of blocks: it preempts the latest arrival, whose whole prefill is thrown away and recomputed later.
On W2 with FP8 weights (1,000 x 1,024 prompt tokens, 128 outputs, 950k KV tokens on an H200) that was 56
preemptions and 59k recomputed prompt tokens, ~4 % of the run (benchmarks/NOTES.md, session 39).

So admission keeps back the blocks the running requests will need soon: the rest of their known tokens (a
prompt's next chunks, a preempted request's recomputation) and the outputs each still has to write to reach
`HORIZON` outputs (fewer where its max_tokens ends sooner; none past the horizon). A fixed horizon rather than
SGLang's share of max_tokens (its `new_token_ratio`): in a scheduler replay (`benchmarks/admission_replay.py`,
NOTES session 39) reserving each request's whole expected output made long generations under memory pressure
~16 % slower (smaller batches cost more than the recomputed prefills they save), and a window of the next 256
outputs of every request held back admissions that never ran short (+2 % with room to spare), while room up to
256 outputs removed W2's preemptions, helped chat-like traffic under pressure and long generations a little,
and cost nothing with room to spare. `scale` (`schedule_conservativeness`, SGLang's name) multiplies the
horizon; 0 turns the reserve off (vLLM's behaviour: admit while the prompt fits, preempt later).

The reserve only decides admission: nothing is set aside in the block pool, and when nothing runs the
reserve is 0, so a request that fits is always admitted (no deadlock).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.request import Request

HORIZON = 256
"""Outputs of each running request that admission keeps room for (times `schedule_conservativeness`)."""


class AdmissionReserve:
    def __init__(self, scale: float, block_size: int) -> None:
        if not scale >= 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got {scale}")
        self.horizon = scale * HORIZON
        self.block_size = block_size

    @property
    def enabled(self) -> bool:
        return self.horizon > 0

    def blocks(self, running: Iterable[Request]) -> int:
        """Blocks to keep free for `running` (their tokens from `num_computed_tokens` on, as scheduled so far
        this step): the known tokens not computed yet and the outputs still to come up to the horizon (or the
        request's max_tokens), one pass a step while requests wait and the cache is tight (~0.2 us a request on
        this box's CPU)."""
        horizon = self.horizon
        tokens = 0.0
        for req in running:
            known = len(req.all_token_ids)
            rest = known - req.num_computed_tokens
            more = min(req.stop_len - known, horizon - len(req.output_token_ids))
            tokens += (rest if rest > 0 else 0) + (more if more > 0 else 0)
        return int(tokens) // self.block_size
