"""How many KV blocks a step must leave free when it admits waiting requests: the running requests' own growth.

Without a reserve the scheduler admits prompts while their blocks fit, and the running requests' decodes then
run out of blocks: it preempts the latest arrival, whose whole prefill is thrown away and recomputed later.
On W2 with FP8 weights (1,000 x 1,024 prompt tokens, 128 outputs, 950k KV tokens on an H200) that was 56
preemptions and 59k recomputed prompt tokens, ~4 % of the run (benchmarks/NOTES.md, session 39).

So, as SGLang does (its `new_token_ratio`), admission keeps back the blocks the running requests are expected
to still need: the rest of their prompts, and `ratio` x their remaining output budget (max_tokens, at most
`CLIP` tokens each). The ratio is learned from finished requests (outputs produced / budget, an exponential
average), starting at 1.0: until a request has finished, outputs are assumed to run to max_tokens. A request
that ends at EOS early lowers it, so chat traffic with large max_tokens reserves little. `scale`
(`schedule_conservativeness`, SGLang's name) multiplies the reserve; 0 turns it off (vLLM's behaviour: admit
while the prompt fits, preempt later).

The reserve only decides admission: nothing is set aside in the block pool, and when nothing runs the
reserve is 0, so a request that fits is always admitted (no deadlock).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.request import Request

CLIP = 4096
"""Output tokens of one request counted at most (SGLang's CLIP_MAX_NEW_TOKENS)."""
MIN_RATIO = 0.05
EMA = 0.1
"""Weight of a finished request in the learned ratio."""


class AdmissionReserve:
    def __init__(self, scale: float, block_size: int) -> None:
        if scale < 0:
            raise ValueError(f"schedule_conservativeness must be >= 0, got {scale}")
        self.scale = scale
        self.block_size = block_size
        self.ratio = 1.0
        """Expected fraction of a request's output budget that it will produce (learned from finished ones)."""

    @property
    def enabled(self) -> bool:
        return self.scale > 0

    def _tokens(self, req: Request, num_computed: int) -> float:
        """The tokens `req` may still add to its KV cache once `num_computed` are: the known ones not computed
        yet (the rest of a prompt, or of a preempted request's recomputation), and its expected outputs."""
        known = req.num_tokens
        return max(known - num_computed, 0) + self.scale * self.ratio * max(min(req.stop_len - known, CLIP), 0)

    def blocks(self, running: Iterable[Request]) -> int:
        """Blocks to keep free for `running` (one pass over them; called only while requests wait)."""
        tokens = 0.0
        for req in running:
            tokens += self._tokens(req, req.num_computed_tokens)
        return int(tokens) // self.block_size

    def blocks_after(self, req: Request, num_computed: int) -> int:
        """What admitting `req` adds to the reserve once `num_computed` of its tokens are scheduled."""
        return int(self._tokens(req, num_computed)) // self.block_size

    def observe_preemption(self) -> None:
        """A running request had to be preempted after all: the reserve was too small."""
        self.ratio = min(1.0, self.ratio + 0.1)

    def observe_finished(self, req: Request) -> None:
        """A request stopped on its own (EOS, a stop string or its length): learn how much of its budget it used."""
        budget = min(req.stop_len - req.num_prompt_tokens, CLIP)
        if budget <= 0:
            return
        used = min(req.num_output_tokens / budget, 1.0)
        self.ratio = max(MIN_RATIO, (1 - EMA) * self.ratio + EMA * used)
