"""Pooling requests in the front end: prompt -> `EngineCoreRequest` (truncation, length checks) and the
core's pooled result -> `PoolingRequestOutput`."""

from __future__ import annotations

import time
from typing import Any

from pagedllm.inputs import PromptType
from pagedllm.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

_PLACEHOLDER = SamplingParams(max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
"""What the scheduler's bookkeeping reads of a pooling request (it never samples)."""


def check_runner(model_config: Any, params: object) -> None:
    """A generation request on a pooling model, or the reverse: ValueError naming the task."""
    pooling = model_config.runner_type == "pooling"
    if pooling and not isinstance(params, PoolingParams):
        tasks = ", ".join(model_config.pooling.tasks)
        raise ValueError(
            f"task: this model is a pooling model (runner='pooling', tasks: {tasks}); it does not support "
            "the task 'generate'"
        )
    if not pooling and isinstance(params, PoolingParams):
        raise ValueError(
            f"task: this model is a generative model (runner='generate'); it does not support the pooling "
            f"task {params.task or 'embed'!r} (start it with runner='pooling')"
        )


def process_pooling(
    processor: Any,
    request_id: str,
    prompt: PromptType,
    params: PoolingParams | SamplingParams,
    arrival_time: float | None,
    priority: int,
    prompt_token_ids: list[int] | None,
    prompt_text: str | None,
    cache_salt: str | None,
) -> tuple[EngineCoreRequest, str | None]:
    mc = processor.model_config
    check_runner(mc, params)
    assert isinstance(params, PoolingParams)
    setup = mc.pooling
    task = params.task or ("embed" if "embed" in setup.tasks else setup.tasks[1])
    hidden = int(getattr(mc.hf_config, "hidden_size", 0))
    params.verify(task, setup.tasks, hidden, bool(getattr(mc.hf_config, "is_matryoshka", False)))
    if prompt_token_ids is None:
        prompt_text, prompt_token_ids, cache_salt = processor.tokenize(prompt)
    ids = list(prompt_token_ids)
    max_len = processor.max_model_len
    t = params.truncate_prompt_tokens
    if t is not None:
        keep = max_len if t == -1 else min(t, max_len)
        ids = ids[-keep:]
    if not ids:
        raise ValueError("prompt: the input is empty (no tokens)")
    if len(ids) > max_len:
        raise ValueError(
            f"prompt: the input has {len(ids)} tokens, more than this model's maximum context length of "
            f"{max_len} tokens (set truncate_prompt_tokens to truncate it)"
        )
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= processor.vocab_size:
        raise ValueError(f"prompt: token id {hi if hi >= processor.vocab_size else lo} is out of the vocabulary")
    req = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=ids,
        sampling_params=_PLACEHOLDER,
        arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        priority=priority,
        cache_salt=cache_salt,
        pooling_params=params.clone(task=task),
    )
    return req, prompt_text


def make_pooling_output(out: EngineCoreOutput, prompt_token_ids: list[int]) -> PoolingRequestOutput:
    assert out.pooling_output is not None
    return PoolingRequestOutput(out.request_id, PoolingOutput(out.pooling_output.to_tensor()), prompt_token_ids)
