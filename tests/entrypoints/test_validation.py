"""Bad input gets a clear error naming the field, and never breaks the engine for later requests."""

from __future__ import annotations

import pytest

from pagedllm import LLM, EngineArgs, SamplingParams, TokensPrompt
from tests.utils_model import make_tiny_hf_model


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"top_k": 2**63}, "top_k"),  # (killed the engine core's input batch: "too large to convert to C long")
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"n": 2**63}, "n"),
    ],
)
def test_sampling_params_errors(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"trust_remote_code": True}, "trust_remote_code"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"block_size": 7}, "block_size"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"schedule_conservativeness": -0.5}, "schedule_conservativeness"),
        ({"dtype": "int3"}, "dtype"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"load_format": "onnx"}, "load_format"),
    ],
)
def test_engine_args_errors(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs).create_engine_config()


def test_unknown_llm_kwarg() -> None:
    with pytest.raises(TypeError, match="not_an_arg"):
        LLM(not_an_arg=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:  # noqa: ANN001
    d = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_hf_model("llama", d)
    return str(d)


def test_kv_cache_too_small_fails_at_startup(tiny_dir: str) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_gpu_blocks_override=4)


def test_bad_prompts_do_not_break_engine(tiny_dir: str) -> None:
    llm = LLM(tiny_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=64, kv_cache_memory_bytes=4 << 20)
    sp = SamplingParams(max_tokens=4, temperature=0, detokenize=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([TokensPrompt(prompt_token_ids=[1] * 64)], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([TokensPrompt(prompt_token_ids=[1, 100000])], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([TokensPrompt(prompt_token_ids=[])], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["text needs a tokenizer"], sp, use_tqdm=False)
    # A batch where the 2nd prompt is bad: nothing runs, nothing leaks.
    with pytest.raises(ValueError):
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2]), TokensPrompt(prompt_token_ids=[])], sp, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], sp, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks - 1
