"""Data parallelism at the AsyncLLM level: two engine cores behind one front end give the outputs of one
engine, both get requests, and their counters go back to zero."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("zmq")

from pagedllm import EngineArgs, SamplingParams, TokensPrompt  # noqa: E402
from pagedllm.engine.async_llm import AsyncLLM  # noqa: E402
from tests.executor.parallel_utils import run_engine, tiny_prompts  # noqa: E402
from tests.utils_model import make_tiny_hf_model  # noqa: E402

ARGS = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 128, "kv_cache_memory_bytes": 8 << 20}


@pytest.mark.slow  # CI time: run by hand (pytest -m slow)
def test_two_cores_match_one_engine(tmp_path) -> None:  # noqa: ANN001
    make_tiny_hf_model("llama", tmp_path)
    prompts = tiny_prompts() * 3
    ref = run_engine(str(tmp_path), prompts, max_num_batched_tokens=None)
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tmp_path), data_parallel_size=2, **ARGS))
    routed: list[int] = []
    engine.engine_core.on_route = routed.append  # type: ignore[attr-defined]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)

    async def one(i: int, p: list[int]) -> list[int]:
        last = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=p), sp, f"r{i}"):
            last = out
        assert last is not None
        return list(last.outputs[0].token_ids)

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    try:
        got = asyncio.run(main())
        assert got == [list(r.token_ids) for r in ref]
        assert sorted(set(routed)) == [0, 1] and len(routed) == len(prompts)
        assert engine.engine_core.in_flight == [0, 0]  # type: ignore[attr-defined]
    finally:
        engine.shutdown()


def test_offline_engine_refuses_data_parallel(tmp_path) -> None:  # noqa: ANN001
    from pagedllm import LLM

    make_tiny_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(tmp_path), data_parallel_size=2, **ARGS)
