"""Speculative decoding: proposers (n-gram, draft model), the verification step and its metrics.

The scheduler carries each request's proposed tokens in `SchedulerOutput.scheduled_spec_decode_tokens`
and schedules them with the request's next token; the model runner hands a step with speculation on to
`SpecDecodeRunner`, which verifies every request's proposals in one forward (`sample/rejection_sampler.py`)
and proposes the next ones."""

from pagedllm.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
