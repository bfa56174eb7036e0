"""The full structured-output run on the real SmolLM2 (CPU, slow): 50 varied prompts under each of 5 JSON
schemas, greedy and sampled, through `LLM.generate` and streamed through `AsyncLLM`: every output parses
and validates against its schema."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("xgrammar")
pytest.importorskip("zmq")

from pagedllm import LLM, EngineArgs, RequestOutputKind, SamplingParams, StructuredOutputsParams  # noqa: E402
from tests.structured_output.cases import SCHEMAS, check_json, prompts  # noqa: E402

N_PROMPTS = 50
MAX_TOKENS = 400

pytestmark = pytest.mark.slow


def cases() -> list[tuple[str, str, SamplingParams]]:
    out = []
    for name, schema in SCHEMAS.items():
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        for i, p in enumerate(prompts(N_PROMPTS)):
            for t in (0.0, 1.0):
                out.append(
                    (p, name, SamplingParams(temperature=t, seed=i, max_tokens=MAX_TOKENS, structured_outputs=so))
                )
    return out


def test_json_schemas_offline(smollm2_llm: LLM) -> None:
    reqs = cases()
    outs = smollm2_llm.generate([p for p, _, _ in reqs], [sp for _, _, sp in reqs], use_tqdm=False)
    for (_, name, _), out in zip(reqs, outs):
        assert out.outputs[0].finish_reason == "stop", (name, out.outputs[0].text)
        check_json(out.outputs[0].text, SCHEMAS[name])


def test_json_schemas_streamed() -> None:
    from pagedllm.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        EngineArgs(max_model_len=2048, kv_cache_memory_bytes=256 << 20, dtype="float32", gguf_dequantize=True)
    )
    reqs = cases()

    async def one(i: int, prompt: str, sp: SamplingParams) -> tuple[str, str | None]:
        text, reason = "", None
        async for out in engine.generate(prompt, sp.clone(output_kind=RequestOutputKind.DELTA), f"r{i}"):
            text += out.outputs[0].text
            reason = out.outputs[0].finish_reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        return list(await asyncio.gather(*(one(i, p, sp) for i, (p, _, sp) in enumerate(reqs))))

    try:
        results = asyncio.new_event_loop().run_until_complete(main())
    finally:
        engine.shutdown()
    for (_, name, _), (text, reason) in zip(reqs, results):
        assert reason == "stop", (name, text)
        check_json(text, SCHEMAS[name])
